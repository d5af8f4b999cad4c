"""Bad input to `qwen-edit` is refused in one line naming it, before any weight loads: decompression bombs
(checked from the header, before decoding), a LoRA whose alpha is empty, `tiny` into a folder of other files,
`bench memory` sizes and control counts it cannot simulate, sizes and steps over the image limits."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qwen_edit_core.cli import main


def _bomb(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims `width` x `height` (no pixel data: decoding it would allocate them)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) +
                     chunk(b"IEND", b""))
    return path


@pytest.fixture
def no_weights(monkeypatch):
    import qwen_edit_core.api as api
    import qwen_edit_core.model.components as components

    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the bad input was reported")
    monkeypatch.setattr(api, "load_components", refuse)
    monkeypatch.setattr(components, "load_components", refuse)


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("side", [9000, 15000])  # over our 64 MP limit; over PIL's own bomb error (2 x 89 MP)
def test_a_decompression_bomb_control_is_refused_before_decoding_and_loading(tiny_edit_dir, tmp_path, capsys,
                                                                             no_weights, side):
    bomb = _bomb(tmp_path / "bomb.png", side, 12000)
    assert main(["sample", "--model", str(tiny_edit_dir), "--image", str(bomb), "--prompt", "x",
                 "--out", str(tmp_path / "o.png")]) == 2
    line = _error(capsys)
    assert str(bomb) in line and "64000000 pixels" in line and "before decoding" in line


def test_the_dataset_and_masks_open_images_through_the_bound(tmp_path):
    from qwen_edit_core.data.images import load_rgb
    with pytest.raises(ValueError, match=r"bomb.png' is 9000x12000, 108000000 pixels, refused before decoding"):
        load_rgb(_bomb(tmp_path / "bomb.png", 9000, 12000))


def test_a_lora_whose_alpha_is_empty_is_refused_naming_the_key(tiny_edit_dir, tmp_path, capsys, no_weights):
    lora = tmp_path / "l.safetensors"
    key = "transformer_blocks.0.attn.to_q"
    save_file({f"{key}.lora_A.weight": torch.zeros(4, 32), f"{key}.lora_B.weight": torch.zeros(32, 4),
               f"{key}.alpha": torch.zeros(0)}, lora)
    from qwen_edit_core.adapters.lora_files import read_lora_file
    with pytest.raises(ValueError, match=rf"key '{key}.alpha' holds 0 values; an alpha is one number"):
        read_lora_file(lora)


def test_tiny_into_a_folder_of_other_files_is_one_line(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["tiny", str(tmp_path)]) == 2
    assert "refusing to replace" in _error(capsys) and (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("args, named", [(["--controls", "-1"], "--controls -1"), (["--size", "0"], "--size 0"),
                                         (["--controls", "4", "--variant", "edit-plus"], "--controls 4"),
                                         (["--comfyui", "--adapter", "dora"], "--comfyui simulates LoRA only"),
                                         (["--sample", "--adapter", "dora"], "--sample simulates LoRA only")])
def test_bench_memory_refuses_what_it_cannot_simulate(capsys, args, named):
    assert main(["bench", "memory", *args]) == 2
    assert named in _error(capsys)


@pytest.mark.parametrize("args, named", [
    (["--width", "200000", "--height", "200000"], "200000x200000 is 40000000000 pixels, over the 64000000 pixel limit"),
    (["--width", "9000", "--height", "9000"], "9000x9000 is 81000000 pixels, over the 64000000 pixel limit"),
    (["--vae-area", "1000000000000"], "predict.vae_area: 1000000000000 must be in [4096, 64000000]"),
    (["--steps", "100000"], "num_inference_steps must be at most 1000, got 100000")])
def test_sizes_and_steps_have_upper_bounds_checked_before_loading(tiny_edit_dir, pairs_dir, tmp_path, capsys,
                                                                  no_weights, args, named):
    assert main(["sample", "--model", str(tiny_edit_dir), "--image", str(pairs_dir / "p0_control.png"),
                 "--prompt", "x", "--out", str(tmp_path / "o.png"), *args]) == 2
    assert named in _error(capsys)
