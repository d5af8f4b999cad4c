"""A scaled-fp8 transformer file is read module by module: host memory stays under the file's size plus the
largest tensor's conversions, not the file plus its upcast copy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch
from safetensors.torch import save_file

_CHILD = textwrap.dedent("""
    import json, sys, torch
    from accelerate import init_empty_weights
    from diffusers import QwenImageTransformer2DModel
    from qwen_edit_core import speed
    from qwen_edit_core.model import file_stream
    from qwen_edit_core.model.single_file import load_transformer_file

    def status(field):
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(field + ":"))

    base = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:  # restart the peak (VmHWM) from here
        fh.write("5")
    # "meta" stands for a GPU: the converted weights leave host memory as they would for cuda.
    model = load_transformer_file(sys.argv[1], device=torch.device("meta"), dtype=torch.bfloat16, fp8="upcast")
    assert model.transformer_blocks[0].img_mod[1].weight.dtype == torch.bfloat16
    print(json.dumps({"peak": status("VmHWM") - base}))
""")


def _scaled_fp8_real_width_file(path) -> tuple[int, int]:
    """One block of the real architecture (3072 wide) in ComfyUI's scaled-fp8 layout, about 360 MB; returns
    (file bytes, largest tensor's element count)."""
    from diffusers import QwenImageTransformer2DModel
    from qwen_edit_core.model.single_file import ARCHITECTURES
    config = {k: v for k, v in json.loads(ARCHITECTURES.read_text())["qwen-image"].items() if not k.startswith("_")}
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in QwenImageTransformer2DModel(**{**config, "num_layers": 1}).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    state = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}
    for key, shape in shapes.items():
        if key.endswith(".weight") and len(shape) == 2:
            # finite e4m3 bytes (0..119: positive normal values) with a per-tensor scale
            state[f"model.diffusion_model.{key}"] = torch.randint(0, 120, shape, dtype=torch.uint8,
                                                                  generator=g).view(torch.float8_e4m3fn)
            state[f"model.diffusion_model.{key.removesuffix('.weight')}.scale_weight"] = torch.tensor(0.01)
        else:
            state[f"model.diffusion_model.{key}"] = torch.randn(shape, generator=g).to(torch.bfloat16)
    save_file(state, str(path))
    return os.path.getsize(path), max(v.numel() for v in state.values())


def test_a_scaled_fp8_file_streams_to_the_device_in_bounded_host_memory(tmp_path):
    path = tmp_path / "transformer_fp8.safetensors"
    size, largest = _scaled_fp8_real_width_file(path)
    assert size > 300 * 2**20
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak = json.loads(proc.stdout.strip().splitlines()[-1])["peak"]
    # The file's mapped pages, plus one tensor as e4m3, fp32 and bf16 (its upcast), plus allocator slack; reading
    # the file whole and upcasting it holds the file twice and its bf16 copy (about 4x the file).
    bound = size + 7 * largest + 64 * 2**20
    assert peak < bound, f"peak host memory {peak / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB"
