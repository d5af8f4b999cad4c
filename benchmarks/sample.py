"""`qwen-edit bench sample`: our sampler against diffusers' QwenImageEditPipeline on the same components.

Both run in one process on the same transformer, VAE and text encoder, the same control image, prompt,
seed and steps; the table gives the median time of each and the ratio (reference / ours, > 1 is faster).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from PIL import Image

from qwen_edit_core import sampler
from qwen_edit_core.devices import resolve_device

from .common import bench_components, median_time, peak_gib, print_table, reset_peak

log = logging.getLogger(__name__)


def _pipeline(comps):
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline
    te = comps.text_encoder
    return QwenImageEditPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(comps.scheduler_config),
                                 vae=comps.vae, text_encoder=te.model, tokenizer=te.processor.tokenizer,
                                 processor=te.processor, transformer=comps.transformer)


def run(real_size: bool = False, device: str = "cpu", steps: int = 4, repeats: int = 3) -> str:
    dev = resolve_device(device, component="bench device")
    dtype = torch.bfloat16 if real_size else torch.float32
    comps = bench_components(real_size, dev, dtype)
    pipe = _pipeline(comps)
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (1024, 1024, 3), dtype=np.uint8))
    prompt, negative = "make the sky purple", " "

    def reference():
        pipe(image=image, prompt=prompt, negative_prompt=negative, true_cfg_scale=4.0, num_inference_steps=steps,
             generator=torch.Generator("cpu").manual_seed(0), output_type="np")

    rows = []
    reset_peak(dev)
    t_ref = median_time(reference, dev, repeats)
    rows.append(["diffusers QwenImageEditPipeline", "sequential", f"{t_ref:.3f}", _gib(peak_gib(dev)), "1.00"])
    for mode in ("sequential", "batched"):
        settings = sampler.SampleSettings(num_inference_steps=steps, true_cfg_scale=4.0, negative_prompt=negative,
                                          seed=0, cfg_mode=mode)
        reset_peak(dev)
        t = median_time(lambda: sampler.sample(comps, prompt, [image], settings), dev, repeats)
        rows.append(["qwen_edit_core sampler", mode, f"{t:.3f}", _gib(peak_gib(dev)), f"{t_ref / t:.2f}"])
    title = (f"sample: {'real-size' if real_size else 'tiny'} transformer, 1024^2 control, {steps} steps, "
             f"true CFG 4.0, {dev}, {dtype}")
    return print_table(title, ["implementation", "cfg", "median s", "peak GiB", "speed vs reference"], rows)


def _gib(value):
    return "-" if value is None else f"{value:.1f}"
