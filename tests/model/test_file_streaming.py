"""A scaled-fp8 transformer file is streamed tensor by tensor to its device: host memory stays under the file's
size plus the largest tensor's upcast, not the whole file plus its upcast copy.

The load runs in a fresh subprocess that reads its own resident memory: the baseline (interpreter and imports)
just before loading, then the peak (VmHWM, restarted at the baseline) after it. The file is read with plain
reads, not memory-mapped, so the page cache never counts as the process's memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from qwen_edit_core.model import file_stream

_CHILD = textwrap.dedent("""
    import gc, json, sys, torch
    import accelerate, diffusers  # the loader's imports belong to the baseline
    from diffusers import QwenImageTransformer2DModel
    from qwen_edit_core import speed
    from qwen_edit_core.model.planned_load import load_transformer_file

    def status(field):
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(field + ":"))

    gc.collect()
    base = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:  # restart the peak (VmHWM) from the current RSS
        fh.write("5")
    # "meta" stands for a GPU: the converted weights leave host memory as they would for cuda.
    model = load_transformer_file(sys.argv[1], device=torch.device("meta"), dtype=torch.bfloat16, fp8="upcast")
    assert model.transformer_blocks[0].img_mlp.net[0].proj.weight.dtype == torch.bfloat16
    print(json.dumps({"base": base, "peak": status("VmHWM")}))
""")


def _scaled_fp8_real_width_file(path) -> tuple[int, int]:
    """One block of the real architecture (3072 wide) in ComfyUI's scaled-fp8 layout, about 360 MB; returns
    (file bytes, largest tensor's element count). Values are constant: only the bytes' count matters here."""
    from diffusers import QwenImageTransformer2DModel
    from qwen_edit_core.model.single_file import ARCHITECTURES
    config = {k: v for k, v in json.loads(ARCHITECTURES.read_text())["qwen-image"].items() if not k.startswith("_")}
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in QwenImageTransformer2DModel(**{**config, "num_layers": 1}).state_dict().items()}
    state = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}
    for key, shape in shapes.items():
        if key.endswith(".weight") and len(shape) == 2:
            state[f"model.diffusion_model.{key}"] = torch.full(shape, 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)
            state[f"model.diffusion_model.{key.removesuffix('.weight')}.scale_weight"] = torch.tensor(0.01)
        else:
            state[f"model.diffusion_model.{key}"] = torch.zeros(shape, dtype=torch.bfloat16)
    save_file(state, str(path))
    return os.path.getsize(path), max(v.numel() for v in state.values())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak RSS from /proc/self/status")
def test_a_scaled_fp8_file_streams_to_the_device_in_bounded_host_memory(tmp_path):
    path = tmp_path / "transformer_fp8.safetensors"
    size, largest = _scaled_fp8_real_width_file(path)
    assert size > 300 * 2**20
    # Every allocation over 64 KiB gets its own mapping, returned on free: the peak counts live memory only.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, timeout=300,
                          env=env)
    path.unlink()
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    peak = result["peak"] - result["base"]
    # Streaming holds one module as read; reading the file whole and upcasting it on the host holds the file,
    # its bf16 copy and an fp32 temporary (about 3.8x the file here). Bound: the file, the largest tensor in
    # bf16 and 32 MiB for the allocator.
    bound = size + 2 * largest + 32 * 2**20
    assert peak < bound, f"peak host memory {peak / 2**20:.0f} MiB over the baseline, bound {bound / 2**20:.0f} MiB"


def test_streamed_tensors_equal_the_safetensors_library_reads(tmp_path):
    from safetensors.torch import load_file
    path = tmp_path / "mixed.safetensors"
    state = {"a.weight": torch.randn(3, 5), "a.bias": torch.randn(5).to(torch.bfloat16), "empty": torch.empty(0),
             "fp8": torch.randn(4, 4).to(torch.float8_e4m3fn), "ids": torch.arange(7), "flag": torch.tensor(True)}
    save_file(state, str(path), metadata={"format": "pt"})
    expected = load_file(str(path))
    got = file_stream.read_tensors(path)
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert torch.equal(got[key].view(torch.uint8), value.view(torch.uint8)), key
    header = file_stream.read_header(path)
    assert {k: (v.shape, v.dtype, v.device.type) for k, v in header.items()} == \
        {k: (v.shape, v.dtype, "meta") for k, v in expected.items()}


def test_a_truncated_file_names_the_tensor(tmp_path):
    path = tmp_path / "cut.safetensors"
    save_file({"big": torch.zeros(1000)}, str(path))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="'big' is truncated"):
        file_stream.read_tensors(path)
