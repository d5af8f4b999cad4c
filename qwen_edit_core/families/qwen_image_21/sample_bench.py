"""`qwen-edit bench sample`, Qwen-Image-2.1 part: the sampler with the prefix K/V cache (the default) against the
same sampler without it, on the same model, references, seed and steps; median time of the denoising loop (the part
the cache changes; prompts and references are encoded once) and the speed-up.

Tiny (CPU): the tiny 2.1 model, 3 references and the output at a 512*512 area. `--real-size` (GPU): real-width
one-layer encoders and the real 32-block, 4096-wide transformer with random bf16 weights at 1024*1024, 3
references. The cached final latent's distance to the uncached one is printed beside (equal up to rounding: fp32
on the CPU, bf16 rounding on the GPU).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from qwen_edit_core.bench.common import default_dtype, median_time, peak_gib, print_table, reset_peak
from qwen_edit_core.model.devices import resolve_device

PROMPT, NEGATIVE = "put the cat from image 2 on the sofa of image 1", " "
#: reference sizes (w, h), different aspects
REFERENCES = ((1024, 768), (768, 1024), (1024, 1024))


def components(real_size: bool, device: torch.device, dtype: torch.dtype):
    """Tiny 2.1 components, or real-width encoders with the real-size random 2.1 transformer."""
    from qwen_edit_core.model.components import load_components
    from qwen_edit_core.model.devices import DevicePlan
    from qwen_edit_core.model.tiny import build_tiny
    from qwen_edit_core.families.qwen_image_21.tiny import transformer_config

    workdir = Path(tempfile.mkdtemp(prefix="qwen-edit-bench-21-"))
    size = "real-width" if real_size else "tiny"
    model_dir = build_tiny(workdir / size, variant="image-2.1", size=size)
    plan = DevicePlan.from_mapping({"text_encoder": str(device), "vae": str(device), "transformer": str(device)},
                                   dtype=dtype)
    comps = load_components(model_dir, plan, which=("vae", "text_encoder") if real_size else
                            ("transformer", "vae", "text_encoder"))
    if real_size:
        from diffusers import QwenImage21Transformer2DModel
        torch.manual_seed(0)
        with default_dtype(dtype), torch.device(device):
            comps.transformer = QwenImage21Transformer2DModel(**transformer_config("real")).eval().requires_grad_(False)
    return comps


def run(real_size: bool = False, device: str = "cpu", steps: int = 4, repeats: int = 3, side: int | None = None) -> str:
    """Time the 2.1 sampler with and without the prefix cache; returns the printed table. `side`: the output's
    area is side^2 (default 1024 real size, 512 tiny)."""
    from qwen_edit_core.sample import sampler
    from qwen_edit_core.families.qwen_image_21 import sampler as sampler21
    dev = resolve_device(device, component="bench device")
    dtype = torch.bfloat16 if real_size else torch.float32
    side = side or (1024 if real_size else 512)
    comps = components(real_size, dev, dtype)
    rng = np.random.default_rng(0)
    refs = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in REFERENCES]
    rows, latents = [], {}
    for cfg in (1.0, 4.0):
        times = {}
        base = sampler.SampleSettings(num_inference_steps=steps, true_cfg_scale=cfg, negative_prompt=NEGATIVE, seed=0,
                                      vae_area=side * side)
        # The references and prompts are encoded once: the cache changes only the denoising loop, which is timed.
        cond = sampler21.build_conditioning(comps, PROMPT, refs, base)
        for cache in (False, True):
            settings = dataclasses.replace(base, kv_cache=cache)
            reset_peak(dev)
            times[cache] = median_time(lambda: latents.__setitem__(cache, sampler21.denoise(comps, cond, settings)),
                                       dev, repeats)
            peak = peak_gib(dev)
            rows.append([f"{cfg:.1f}", "on" if cache else "off", f"{times[cache]:.3f}",
                         "-" if peak is None else f"{peak:.1f}",
                         f"{times[False] / times[cache]:.2f}" if cache else "1.00",
                         f"{(latents[True] - latents[False]).abs().max():.1e}" if cache else "-"])
    title = (f"sample Qwen-Image-2.1: {'real-size' if real_size else 'tiny'} transformer, {len(refs)} references, "
             f"{side}^2, {steps} steps, {dev}, {dtype}: prefix K/V cache (default) vs none")
    columns = ["cfg", "prefix cache", "denoise median s", "peak GiB", "speed-up", "max |diff| vs off"]
    return print_table(title, columns, rows)
