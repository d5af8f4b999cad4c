"""Encode, decode and sampling nodes: true CFG, each CFG branch on the device the user picks."""

from __future__ import annotations

import dataclasses

import torch

from qwen_edit_core.model import encode
from qwen_edit_core.adapters import lora
from qwen_edit_core import speed
from qwen_edit_core.sample import sampler
from qwen_edit_core.model.components import replicate
from qwen_edit_core.model.devices import resolve_device
from qwen_edit_core.common.progress import Cancelled, CancelToken

from . import comfy_runtime
from .common import CATEGORY, CONDITIONING, LATENT, MODEL, device_choices, image_to_pils

SHIFT_MODES = ["dynamic", "fixed (ComfyUI mu 1.15)"]
# Widget specs several nodes share (same names, defaults and ranges everywhere).
PROMPT = ("STRING", {"multiline": True, "default": "make the sky purple"})
NEGATIVE = ("STRING", {"multiline": True, "default": " "})
STEPS = ("INT", {"default": 20, "min": 1, "max": 200})
SEED = ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF, "control_after_generate": True})
VAE_SIDE = ("INT", {"default": 1024, "min": 64, "max": 2048, "step": 32,
                    "tooltip": "control images are resized to this side squared in pixels"})


def _size(name: str) -> tuple:
    return ("INT", {"default": 0, "min": 0, "max": 4096, "step": 16, "tooltip": f"0: {name} from the image"})


def _controls(image, image2=None, image3=None) -> list:
    return [image_to_pils(img)[0] for img in (image, image2, image3) if img is not None]


def _settings(steps=20, cfg=4.0, seed=0, width=0, height=0, shift_mode="dynamic", negative=" ", cfg_mode="batched",
              vae_area=1024, vl_area=384) -> sampler.SampleSettings:
    return sampler.SampleSettings(num_inference_steps=steps, true_cfg_scale=cfg, negative_prompt=negative, seed=seed,
                                  width=width or None, height=height or None, cfg_mode=cfg_mode,
                                  shift_mode="fixed" if shift_mode.startswith("fixed") else "dynamic",
                                  vae_area=vae_area * vae_area, vl_area=vl_area * vl_area)


def _preview(latents: torch.Tensor, width: int, height: int):
    """A cheap preview: three latent channels as RGB (no VAE decode per step)."""
    from PIL import Image
    grid = encode.unpack(latents[:1].float().cpu(), height, width)[0, :3, 0]
    lo, hi = grid.amin(dim=(1, 2), keepdim=True), grid.amax(dim=(1, 2), keepdim=True)
    rgb = ((grid - lo) / (hi - lo + 1e-6) * 255).byte().permute(1, 2, 0).numpy()
    return ("JPEG", Image.fromarray(rgb), 256)


def _run(model, cond: sampler.Conditioning, settings: sampler.SampleSettings, uncond_device: str, unique_id=None):
    comps = model.components
    lora.activate(comps.transformer, model.loras)
    settings = dataclasses.replace(settings, attention=model.attention)
    replica = None
    main_device = next(comps.transformer.parameters()).device
    if settings.do_cfg and uncond_device not in ("same", str(main_device)):
        key = (uncond_device, model.loras)
        if key not in model.replicas:
            model.replicas.clear()  # one replica at a time: a 20 B model does not fit twice per device
            model.replicas[key] = replicate(comps.transformer, resolve_device(uncond_device,
                                                                              component="uncond_device"))
        replica = model.replicas[key]
        settings = dataclasses.replace(settings, cfg_mode="split")
    bar = comfy_runtime.progress_bar(settings.num_inference_steps, node_id=unique_id)
    token = CancelToken()

    def progress(event):
        bar.update_absolute(event.step, event.total, _preview(event.preview, cond.width, cond.height))
        if comfy_runtime.interrupt_requested():
            token.cancel()

    try:
        latents = sampler.denoise(comps, cond, settings, uncond_transformer=replica, progress=progress, cancel=token)
    except Cancelled:
        comfy_runtime.raise_if_interrupted()
        raise
    return sampler.decode(comps, latents, cond.width, cond.height)


class QwenEditSampler:
    """Edit an image (1 to 3 for Edit Plus) with true CFG. One CFG device: cond and uncond batched; two devices:
    both branches at once, the uncond one on a replica on `uncond_device`."""

    CATEGORY = f"{CATEGORY}/sampling"
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("image",)
    FUNCTION = "sample"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": (MODEL,), "image": ("IMAGE",), "prompt": PROMPT, "negative_prompt": NEGATIVE, "steps": STEPS,
            "true_cfg_scale": ("FLOAT", {"default": 4.0, "min": 0.0, "max": 20.0, "step": 0.1,
                                         "tooltip": "<= 1 turns CFG off (one transformer call per step)"}),
            "seed": SEED, "width": _size("width"), "height": _size("height"), "shift_mode": (SHIFT_MODES,),
            "uncond_device": (["same"] + device_choices(), {"tooltip": "same: batched CFG on the model's device"}),
            "vae_side": VAE_SIDE,
        }, "optional": {"image2": ("IMAGE",), "image3": ("IMAGE",)},
            "hidden": {"unique_id": "UNIQUE_ID"}}

    def sample(self, model, image, prompt, negative_prompt, steps, true_cfg_scale, seed, width, height, shift_mode,
               uncond_device, vae_side, image2=None, image3=None, unique_id=None):
        with torch.inference_mode(False), torch.no_grad():
            settings = _settings(steps, true_cfg_scale, seed, width, height, shift_mode, negative_prompt,
                                 vae_area=vae_side)
            cond = sampler.build_conditioning(model.components, prompt, _controls(image, image2, image3), settings)
            return (_run(model, cond, settings, uncond_device, unique_id),)


class QwenEditEncodePrompt:
    """Prompt + negative prompt + control image(s) -> conditioning for QwenEditSampleConditioning."""

    CATEGORY = f"{CATEGORY}/encode"
    RETURN_TYPES = (CONDITIONING,)
    RETURN_NAMES = ("conditioning",)
    FUNCTION = "encode"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": (MODEL,), "image": ("IMAGE",), "prompt": PROMPT, "negative_prompt": NEGATIVE,
                             "width": _size("width"), "height": _size("height"), "vae_side": VAE_SIDE},
                "optional": {"image2": ("IMAGE",), "image3": ("IMAGE",)}}

    def encode(self, model, image, prompt, negative_prompt, width, height, vae_side, image2=None, image3=None):
        settings = _settings(width=width, height=height, negative=negative_prompt, vae_area=vae_side)
        with torch.inference_mode(False), torch.no_grad():
            return (sampler.build_conditioning(model.components, prompt, _controls(image, image2, image3), settings),)


class QwenEditSampleConditioning:
    CATEGORY = f"{CATEGORY}/sampling"
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("image",)
    FUNCTION = "sample"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": (MODEL,), "conditioning": (CONDITIONING,), "steps": STEPS,
                             "true_cfg_scale": ("FLOAT", {"default": 4.0, "min": 0.0, "max": 20.0, "step": 0.1}),
                             "seed": SEED,
                             "shift_mode": (SHIFT_MODES,), "uncond_device": (["same"] + device_choices(),)},
                "hidden": {"unique_id": "UNIQUE_ID"}}

    def sample(self, model, conditioning, steps, true_cfg_scale, seed, shift_mode, uncond_device, unique_id=None):
        settings = _settings(steps, true_cfg_scale, seed, shift_mode=shift_mode)
        if conditioning.uncond is None and settings.do_cfg:
            settings = dataclasses.replace(settings, negative_prompt=None)
        with torch.inference_mode(False), torch.no_grad():
            return (_run(model, conditioning, settings, uncond_device, unique_id),)


class QwenEditEncodeImage:
    CATEGORY = f"{CATEGORY}/encode"
    RETURN_TYPES = (LATENT,)
    RETURN_NAMES = ("latent",)
    FUNCTION = "encode"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": (MODEL,), "image": ("IMAGE",), "vae_side": VAE_SIDE}}

    def encode(self, model, image, vae_side):
        comps = model.components
        comps.require("vae")
        with torch.inference_mode(False), torch.no_grad():
            latents = []
            for pil in image_to_pils(image):
                size = encode.image_size_at_area(pil, vae_side * vae_side)
                latents.append(encode.encode_latents(comps.vae, encode.pixels_for_vae(pil, *size)))
            return (latents,)


class QwenEditDecodeLatent:
    CATEGORY = f"{CATEGORY}/encode"
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("image",)
    FUNCTION = "decode"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": (MODEL,), "latent": (LATENT,)}}

    def decode(self, model, latent):
        comps = model.components
        comps.require("vae")
        with torch.inference_mode(False), torch.no_grad():
            images = [encode.postprocess(encode.decode_latents(comps.vae, x)).cpu() for x in latent]
        if len({tuple(i.shape) for i in images}) > 1:
            raise ValueError("latents of different sizes cannot form one IMAGE batch; decode them separately")
        return (torch.cat(images),)


class QwenEditSpeed:
    """Sampling speed levers for a loaded model: fp8 matmuls for the base's block linears (Ada/Hopper GPUs),
    compiled transformer blocks, and the attention kernel tried first. Returns a new model that shares every
    weight the levers leave alone; the input model is not changed (other graphs using it sample as before).
    LoRAs still load and switch on top."""

    CATEGORY = f"{CATEGORY}/sampling"
    RETURN_TYPES = (MODEL,)
    RETURN_NAMES = ("model",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": (MODEL,),
            "fp8": ("BOOLEAN", {"default": False, "tooltip": "e4m3 base weights, fp8 matmuls: ~1.6x faster "
                                                             "linears, half the weight memory; LoRAs stay bf16"}),
            "compile": ("BOOLEAN", {"default": False, "tooltip": "compile each block once (~30 s on first use)"}),
            "attention": (list(speed.ATTENTION_KERNELS), {"tooltip": "cudnn: fastest on Hopper GPUs"}),
        }}

    def apply(self, model, fp8, compile, attention):
        transformer = model.components.transformer
        device = next(transformer.parameters()).device
        if not fp8 and not compile:  # nothing to change in the weights: share the transformer itself
            return (dataclasses.replace(model, attention=attention),)
        with torch.inference_mode(False):
            fresh = speed.inference_copy(transformer, device, fp8=fp8, compile=compile)
        components = dataclasses.replace(model.components, transformer=fresh)
        return (dataclasses.replace(model, components=components, replicas={}, attention=attention),)
