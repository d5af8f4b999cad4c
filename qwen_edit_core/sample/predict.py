"""The predict path as plain functions over loaded components: ready the transformer for sampling, the sampler's
settings from `predict.*` and call arguments, the output formats, and the single-input encoders
(`encode_prompt`, `encode_image`, `decode`) that `QwenImageEditTrainer` exposes.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from qwen_edit_core.model import encode

from qwen_edit_core.families import variants
from qwen_edit_core.model.components import replicate
from qwen_edit_core.sample.sampler import SampleSettings

OUTPUT_TYPES = ("np", "pil", "pt")


def prepare_transformer(components, device: torch.device, predict):
    """Ready loaded components for sampling: eval mode; `predict.fp8` / `predict.compile` applied to the
    transformer in place (qwen_edit_core.speed; it stays so until reloaded); context parallelism
    (`predict.context_parallel`, sample.context_parallel). Returns this process's CFG branch
    (context_parallel.CfgSplit) under context parallelism with `cfg_mode: split`, else None."""
    components.transformer.eval()
    if predict.fp8 or predict.compile:
        from qwen_edit_core import speed
        speed.configure_inference(components.transformer, device, fp8=predict.fp8, compile=predict.compile)
    if predict.context_parallel > 1:
        from qwen_edit_core.sample import context_parallel
        return context_parallel.enable(components.transformer, predict.context_parallel, predict.cp_mode,
                                       cfg_split=predict.cfg_mode == "split")
    return None


def sampling_plan(device: torch.device, dtype: torch.dtype, predict):
    """The transformer's memory plan for sampling, made before it loads: with `predict.fp8` its block linears are
    streamed straight into fp8 (model/planned_load.py), so the bf16 weights never fill the device first; None
    (loaded as stored) otherwise. Refused before loading where the device has no fp8 matmuls."""
    if not predict.fp8:
        return None
    from qwen_edit_core import speed
    return speed.checked_plan(device, dtype, 0, fp8=True, n_checkpointed=None, n_offloaded=0)


def uncond_replica(components, device: torch.device, uncond_device: torch.device | None):
    """The transformer's replica for `predict.cfg_mode: split`, on `uncond_device` (default the transformer's)."""
    return replicate(components.transformer, uncond_device or device)


def settings(predict, *, schedule: str | None, shift: float | None, num_inference_steps: int | None,
             true_cfg_scale: float | None, negative_prompt: str | None, seed: int | None, width: int | None,
             height: int | None, sigmas=None) -> SampleSettings:
    """The sampler's settings: the call's arguments over `predict.*`. Steps and CFG not given: the named
    schedule's (sample/schedules.py), else `predict.num_inference_steps` / `predict.true_cfg_scale`. `sigmas`
    (else `predict.sigmas`): an explicit sigma list or preset name; its length is the step count, and a preset's
    CFG scale applies when none is given."""
    from qwen_edit_core.sample import schedules
    schedule = schedule or predict.schedule
    grid, preset_cfg = schedules.resolve_sigmas(sigmas if sigmas else predict.sigmas)
    if true_cfg_scale is None and preset_cfg is not None:
        true_cfg_scale = preset_cfg
    steps, cfg = schedules.steps_and_cfg(schedule, len(grid) if grid else num_inference_steps, true_cfg_scale,
                                         predict.num_inference_steps, predict.true_cfg_scale)
    return SampleSettings(
        num_inference_steps=steps, true_cfg_scale=cfg, negative_prompt=negative_prompt, seed=seed, width=width,
        height=height, cfg_mode=predict.cfg_mode, shift_mode=predict.shift_mode, fixed_mu=predict.fixed_mu,
        vae_area=predict.vae_area, vl_area=predict.vl_area, attention=predict.attention, schedule=schedule,
        shift=shift if shift is not None else predict.shift, control_size=predict.control_size, sigmas=grid,
        kv_cache=predict.kv_cache)


def check_output_type(output_type: str) -> None:
    if output_type not in OUTPUT_TYPES:
        raise ValueError(f"output_type {output_type!r} is not accepted; accepted: {', '.join(OUTPUT_TYPES)}")


def to_output(image: torch.Tensor, output_type: str):
    """A sampled (1, H, W, 3) [0, 1] image as float32 (H, W, 3) ("np"), a PIL image ("pil") or as it is ("pt")."""
    check_output_type(output_type)
    if output_type == "pt":
        return image
    array = image[0].numpy().astype(np.float32)
    if output_type == "pil":
        return Image.fromarray((array * 255).round().astype(np.uint8))
    return array


def encode_prompt(components, prompt: str, image, *, area: int | None, vae_area: int,
                  vl_area: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_embeds (1, S, D), mask (1, S)) for a prompt and its control image(s), on the TE device. The VL
    sees the images at `area`, default the variant's (families/variants.py `Variant.vl_area`)."""
    components.require("text_encoder")
    images = [encode.to_pil(i) for i in (image if isinstance(image, (list, tuple)) else [image])]
    area = area or variants.get(components.variant).vl_area(vae_area, vl_area)
    vl = [encode.resize(i, *encode.image_size_at_area(i, area)) for i in images]
    te = components.text_encoder
    family = variants.get(components.variant).family
    encode_prompts = getattr(family.stage("encode"), "encode_prompts", None)
    if encode_prompts is None:
        raise encode.EncodeError(f"{family.title} prompts are encoded with their reference images' vision slots, "
                                 "inside sampling: sample with `predict` instead")
    (emb,) = encode_prompts(te.model, te.processor, [prompt], [vl], components.variant, device=te.device)
    embeds = encode.pad_embeddings([emb])
    return embeds.embeds, embeds.mask


def encode_image(components, image, area: int) -> torch.Tensor:
    """Normalized VAE latents (1, C, 1, h, w) of an image at `area` (C: the VAE's latent channels), the image sized
    and converted as its family's pipeline does (`vae_pixels` of families/<family>/encode.py)."""
    components.require("vae")
    pixels = variants.get(components.variant).family.stage("encode").vae_pixels(image, area)
    return encode.encode_latents(components.vae, pixels)


def decode(components, latents: torch.Tensor) -> torch.Tensor:
    """Normalized latents (B, C, 1, h, w) -> (B, H, W, 3) float32 in [0, 1], on the CPU ((B, H, W, 4) RGBA for
    a Qwen-Image-2.1 VAE)."""
    components.require("vae")
    return encode.postprocess(encode.decode_latents(components.vae, latents)).cpu()
