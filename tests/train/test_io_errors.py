"""One I/O error for every writer: the cache entries, validation pictures, held-out metrics, the loss log, the
pair writer and the LoRA's delivery into ComfyUI's folder each name the path and "the disk is full", the CLI
exits 2 without a traceback, and a half-written cache entry is never left under its name."""

from __future__ import annotations

import builtins
import errno
import os
from pathlib import Path

import pytest
import yaml

from qwen_edit_core.cli import main
from qwen_edit_core.common.files import OutputWriteError


class _FullFile:
    """An open file on a full disk: every write raises ENOSPC, as the kernel's write(2) does."""

    def __init__(self, path):
        self.name = str(path)

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def flush(self):
        pass

    def close(self):
        pass


def _full_disk(monkeypatch, marker: str) -> None:
    """Every write to a path holding `marker` meets a full disk (ENOSPC from the write, nothing written)."""
    import safetensors.torch as st
    real_open, real_save = builtins.open, st.save_file

    def guarded_open(file, mode="r", *a, **k):
        if isinstance(file, (str, os.PathLike)) and marker in str(file) and any(m in mode for m in "wax+"):
            return _FullFile(file)
        return real_open(file, mode, *a, **k)

    def guarded_save(tensors, filename, metadata=None):
        if marker in str(filename):  # safetensors' own words for ENOSPC
            from safetensors import SafetensorError
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real_save(tensors, filename, metadata=metadata)
    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(st, "save_file", guarded_save)


def _cfg(tmp_path, model, data, **train) -> Path:
    cfg = {"model": {"pretrained_model_name_or_path": str(model), "lora": {"rank": 4, "targets": "attn"}},
           "data": {"folder": str(data), "vae_area": 4096, "batch_size": 1},
           "cache": {"dir": str(tmp_path / "cache")},
           "train": {"output_dir": str(tmp_path / "o"), "max_steps": 2, "seed": 3, **train}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


WRITERS = {  # writer -> (the marker of its paths, its settings, what the message names)
    # (the cache stage writes the first safetensors files of a run: its entries, under temporary names)
    "cache": (".safetensors.", {}, "could not write an embedding cache entry to '{tmp}/cache/"),
    "validation": ("/validation/", {"validation_every": 1, "validation_steps": 1, "validation_prompt": "x"},
                   "could not write the validation picture of step 1 to '{tmp}/o/validation/step-0000001"),
    "heldout": ("/heldout/", {"validation_every": 1, "validation_steps": 1, "validation_pairs": 1},
                "could not write a held-out pair's picture to '{tmp}/o/validation/heldout/step-0000001/"),
    "metrics": ("metrics.csv", {"validation_every": 1, "validation_steps": 1, "validation_pairs": 1},
                "could not write the held-out metrics to '{tmp}/o/validation/metrics.csv'"),
    "loss log": ("loss.csv", {"checkpoint_every": 1},
                 "could not write the loss of step 2 to '{tmp}/o/loss.csv' (train.output_dir)"),
}


@pytest.mark.parametrize("writer", WRITERS)
def test_a_full_disk_in_any_training_writer_is_one_line_and_exit_2(tiny_edit_dir, pairs_dir, tmp_path, monkeypatch,
                                                                   capsys, writer):
    marker, train, expected = WRITERS[writer]
    if "validation_prompt" in train:
        train = {**train, "validation_image": str(pairs_dir / "p0_control.png")}
    if writer == "loss log":
        # the first step's row is written; the second's meets the full disk
        real_add = __import__("qwen_edit_core.train.log", fromlist=["LossLog"]).LossLog.add

        def add(self, step, loss, lr):
            if step == 2:
                _full_disk(monkeypatch, marker)
            return real_add(self, step, loss, lr)
        monkeypatch.setattr("qwen_edit_core.train.log.LossLog.add", add)
    else:
        _full_disk(monkeypatch, marker)
    assert main(["train", str(_cfg(tmp_path, tiny_edit_dir, pairs_dir, **train))]) == 2
    err = capsys.readouterr().err
    line = next((line for line in err.splitlines() if line.startswith("qwen-edit train: error: ")), err)
    assert expected.format(tmp=tmp_path) in line and "the disk is full" in line, err
    assert "Traceback" not in err, err
    if writer == "loss log":
        assert "The checkpoint at step 1 is intact" in err and "--resume" in err
    if writer == "cache":  # nothing under an entry's name, no temporary file left
        assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and "safetensors" in p.name]


def test_a_full_disk_in_the_pair_writer_names_the_pair_and_leaves_nothing(tmp_path, monkeypatch):
    from PIL import Image

    from qwen_edit_core.data.pair_writer import NewPair, add_pairs
    folder = tmp_path / "pairs"
    folder.mkdir()
    _full_disk(monkeypatch, str(folder))
    pair = NewPair((Image.new("RGB", (64, 64)),), Image.new("RGB", (64, 64), "white"), "invert")
    with pytest.raises(OutputWriteError, match=rf"could not write pair 'pair_00001' to '{folder}': the disk is full"):
        add_pairs(folder, [pair])
    assert list(folder.iterdir()) == []


def test_a_full_disk_while_delivering_the_lora_to_comfyui_names_both_files(tmp_path, monkeypatch):
    from nodes import job_service
    lora = tmp_path / "o" / "lora.safetensors"
    lora.parent.mkdir()
    lora.write_bytes(b"x" * 1000)
    loras = tmp_path / "loras"
    monkeypatch.setenv("QWEN_EDIT_LORAS", str(loras))
    _full_disk(monkeypatch, str(loras))
    with pytest.raises(OutputWriteError) as err:
        job_service.deliver(lora)
    text = str(err.value)
    assert text.startswith(f"could not write the LoRA delivered to ComfyUI's loras folder to "
                           f"'{loras / 'lora.safetensors'}': the disk is full") and str(lora) in text
    assert not [p for p in loras.iterdir()]
