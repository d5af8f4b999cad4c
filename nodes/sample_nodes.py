"""Encode, decode and sampling nodes: true CFG, each CFG branch on the device the user picks."""

from __future__ import annotations

import dataclasses

import torch

from qwen_edit_core.model import encode
from qwen_edit_core.adapters import lora
from qwen_edit_core import jobs, speed
from qwen_edit_core.sample import sampler, schedules, workers
from qwen_edit_core.model.components import replicate
from qwen_edit_core.families.templates import EMPTY_PROMPT
from qwen_edit_core.model.devices import resolve_device
from qwen_edit_core.common.progress import Cancelled, CancelToken

from qwen_edit_core.families import variants

from . import comfy_runtime, loaded_models, references as reference_sampling
from .common import (AUTO_CFG, CATEGORY, CONDITIONING, LATENT, MODEL, REFERENCES, TIPS, auto_cfg, device_choices,
                     image_to_pils, side_of)

SHIFT_MODES = ["dynamic", "fixed (ComfyUI mu 1.15)"]
# Widget specs several nodes share (same names, defaults and ranges everywhere).
MODEL_IN = (MODEL, {"tooltip": TIPS["model"]})
IMAGE_IN = ("IMAGE", {"tooltip": TIPS["image"]})
EXTRA_IMAGES = {f"image{i}": ("IMAGE", {"tooltip": f"control image {i} (Edit Plus models take up to 3)"})
                for i in (2, 3)}
PROMPT = ("STRING", {"multiline": True, "default": "make the sky purple", "placeholder": "prompt: the edit",
                     "tooltip": "the edit instruction, e.g. 'make the sky purple', 'remove the cup'"})
NEGATIVE = ("STRING", {"multiline": True, "default": "",
                       "placeholder": "negative prompt: what to steer away from (empty: the reference's ' ')",
                       "tooltip": "what to steer away from, e.g. 'blurry, distorted'; empty (or blank) is a single "
                                  "space, the reference pipeline's default"})
STEPS = ("INT", {"default": 20, "min": 1, "max": 200,
                 "tooltip": "denoising steps: 20-50 for real models (the reference uses 50), 4-8 for the tiny one"})
CFG = ("FLOAT", {"default": AUTO_CFG, "min": AUTO_CFG, "max": 20.0, "step": 0.1, "round": 0.01,
                 "tooltip": "true CFG scale: -1 (auto): the schedule's or sigma preset's (lightning: 1), else the "
                            "model's: 4.0 for real Qwen-Image-Edit models (3-5 typical), 1 for Qwen-Image-2.1 "
                            "(CFG-distilled) and the built-in toy ones; 0 to 1 turns CFG off (one transformer call "
                            "per step, twice as fast)"})
SEED = ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF, "control_after_generate": True,
                "tooltip": "noise seed: the same seed and settings give the same image"})
SHIFT = (SHIFT_MODES, {"tooltip": "timestep shift: dynamic by image size (diffusers' pipeline, mu from the "
                                  "token count), or ComfyUI's fixed shift 1.15 (ModelSamplingAuraFlow default)"})
UNCOND = (["same"] + device_choices(), {"tooltip": "same: batched CFG on the model's device; another device "
                                                   "(e.g. cuda:1): both CFG branches at once, uncond on a copy there"})
VAE_SIDE = ("INT", {"default": 0, "min": 0, "max": 2048, "step": 32,
                    "tooltip": "control images are resized to about this side squared in pixels; 0 (auto): the "
                               "model's own size (1024, ~1 megapixel, for real models; 128 for the built-in toy "
                               "ones); 512 for quick tries"})


PARALLEL = ("BOOLEAN", {
    "default": False,
    "tooltip": "run the transformer on every GPU at once: one worker process per GPU, each with a copy of the "
               "model and 1/N of the image and prompt tokens (context parallel), started on first use and kept "
               "for the next runs; helps at any CFG, CFG 1 included. Needs 2+ GPUs (or the devices listed in "
               f"${workers.DEVICES_ENV}); uncond_device must be same"})
SCHEDULE = (list(schedules.SCHEDULES), {
    "default": "diffusers",
    "tooltip": "diffusers: the pipelines' schedule and true CFG; comfyui: what stock ComfyUI renders (its model "
               "sampling, simple scheduler, Euler, plain CFG and noise), to preview a LoRA as ComfyUI users see "
               "it; lightning: few-step Lightning LoRAs (fixed shift 3; run 4 or 8 steps at CFG 1)"})
SIGMAS = ("STRING", {
    "default": "",
    "tooltip": "an explicit sigma list instead of the schedule's: comma-separated, decreasing, in (0, 1], e.g. "
               "'1.0, 0.75, 0.5, 0.25' (its length is the step count), or a preset: "
               + ", ".join(f"{name} ({about})" for name, (_, _, about) in schedules.SIGMA_PRESETS.items())
               + ". Few-step adapters need their own list; empty: the schedule's"})
REFERENCES_IN = (REFERENCES, {"tooltip": "Qwen-Image-2.1: more reference images, in order, after the image input's "
                                         "batch (Reference Images nodes; up to 10 in all, any sizes)"})
SHIFT_VALUE = ("FLOAT", {"default": 0.0, "min": 0.0, "max": 100.0, "step": 0.01, "round": 0.01,
                         "tooltip": "0: the schedule's own shift; > 0: a fixed shift, e.g. 3 (comfyui: the shift "
                                    "of ComfyUI's ModelSamplingAuraFlow node)"})


def _size(name: str) -> tuple:
    return ("INT", {"default": 0, "min": 0, "max": 4096, "step": 16,
                    "tooltip": f"output {name} in pixels (multiple of 16); 0: from the first control image"})


def _controls(model, image, image2=None, image3=None) -> list:
    """The connected control images as PIL images; more than the model takes is refused in the graph's words
    (which inputs, which model to load) before the core's check, which speaks of the command line's variants."""
    pils = [image_to_pils(img)[0] for img in (image, image2, image3) if img is not None]
    spec = variants.get(model.components.variant)
    if spec.max_controls is not None and len(pils) > spec.max_controls:
        todo = (f"connect at most {spec.max_controls}" if spec.max_controls > 1 else "disconnect image2 and image3, "
                "or pick an Edit Plus model (Qwen-Image-Edit-2509 or -2511) in Load Model: they take up to 3")
        raise ValueError(f"this {spec.title} model takes {spec.controls_text()}, got {len(pils)} (image, image2, "
                         f"image3): {todo}")
    return pils


def _settings(steps=20, cfg=4.0, seed=0, width=0, height=0, shift_mode="dynamic", negative="", cfg_mode="batched",
              vae_area=1024, vl_area=384, schedule="diffusers", shift=0.0,
              control_size="pipeline", sigmas="") -> sampler.SampleSettings:
    negative = negative if negative.strip() else EMPTY_PROMPT  # a blank box is the reference's negative prompt
    grid, _ = schedules.resolve_sigmas(sigmas)
    return sampler.SampleSettings(num_inference_steps=len(grid) if grid else steps, sigmas=grid, true_cfg_scale=cfg,
                                  negative_prompt=negative, seed=seed,
                                  width=width or None, height=height or None, cfg_mode=cfg_mode,
                                  shift_mode="fixed" if shift_mode.startswith("fixed") else "dynamic",
                                  vae_area=vae_area * vae_area, vl_area=vl_area * vl_area, schedule=schedule,
                                  shift=shift or None, control_size=control_size)


def cfg_of(cfg: float, handle, schedule: str = "diffusers", sigmas: str = "") -> float:
    """The CFG input's scale: itself, or (below 0, "auto") the sigma preset's, else the schedule's (lightning:
    1), else the model's (`auto_cfg`)."""
    if cfg >= 0:
        return cfg
    _, preset = schedules.resolve_sigmas(sigmas)
    if preset is not None:
        return preset
    return schedules.steps_and_cfg(schedule, 1, None, fallback_cfg=auto_cfg(handle))[1]


#: previews per sampling run: each one copies the latents to the host (a device sync), so not every step
PREVIEWS = 8


def preview_due(step: int, total: int) -> bool:
    """Whether step `step` (1-based) of `total` sends a preview: about PREVIEWS evenly spaced, and the last."""
    return step == total or step % max(1, -(-total // PREVIEWS)) == 0


def _preview(latents: torch.Tensor, width: int, height: int, unpack):
    """A cheap preview: three latent channels as RGB (no VAE decode per step); `unpack`: the family sampler's."""
    from PIL import Image
    grid = unpack(latents[:1].float().cpu(), width, height)[0, :3, 0]
    lo, hi = grid.amin(dim=(1, 2), keepdim=True), grid.amax(dim=(1, 2), keepdim=True)
    rgb = ((grid - lo) / (hi - lo + 1e-6) * 255).byte().permute(1, 2, 0).numpy()
    return ("JPEG", Image.fromarray(rgb), 256)


def parallel_components(model, uncond_device: str = "same"):
    """The model's components with the transformer run by the pack's worker pool (sample.workers.shared_pool:
    one worker per device of `workers.parallel_devices()`, started once per model, LoRA stack and devices)."""
    comps = model.components
    jobs.REGISTRY.check_free(comps.transformer, "sample")  # a job may train on this very transformer
    if uncond_device not in ("same", str(next(comps.transformer.parameters()).device)):
        raise ValueError(f"parallel runs both CFG branches on every GPU; uncond_device {uncond_device} would need "
                         "a second copy: set uncond_device to same")
    pool = workers.shared_pool(comps.transformer, workers.parallel_devices(), attention=model.attention,
                               tag=model.loras)
    return dataclasses.replace(comps, transformer=pool)


def _run(model, cond, settings: sampler.SampleSettings, uncond_device: str, unique_id=None,
         parallel: bool = False):
    comps = model.components
    jobs.REGISTRY.check_free(comps.transformer, "sample")  # a job may train on this very transformer
    lora.activate(comps.transformer, model.loras)
    settings = dataclasses.replace(settings, attention=model.attention)
    replica = None
    main_device = next(comps.transformer.parameters()).device
    if parallel:
        comps = parallel_components(model, uncond_device)
    elif not settings.do_cfg and uncond_device not in ("same", str(main_device)):
        settings = dataclasses.replace(settings, cfg_mode="split")  # the sampler logs that nothing is split
    elif settings.do_cfg and uncond_device not in ("same", str(main_device)):
        key = (uncond_device, model.loras)
        if key not in model.replicas:
            model.replicas.clear()  # one replica at a time: a 20 B model does not fit twice per device
            model.replicas[key] = replicate(comps.transformer, resolve_device(uncond_device,
                                                                              component="uncond_device"))
        replica = model.replicas[key]
        settings = dataclasses.replace(settings, cfg_mode="split")
    bar = comfy_runtime.progress_bar(settings.num_inference_steps, node_id=unique_id)
    token = CancelToken()
    unpack = sampler.family_sampler(comps).unpack

    def progress(event):
        due = preview_due(event.step, event.total)
        preview = _preview(event.preview, cond.width, cond.height, unpack) if due else None
        bar.update_absolute(event.step, event.total, preview)
        if comfy_runtime.interrupt_requested():
            token.cancel()

    try:
        latents = sampler.denoise(comps, cond, settings, uncond_transformer=replica, progress=progress, cancel=token)
    except Cancelled:
        comfy_runtime.raise_if_interrupted()
        raise
    return sampler.decode(comps, latents, cond.width, cond.height), stock_latent(comps, latents, cond)


def stock_latent(comps, latents: torch.Tensor, cond) -> dict:
    """Packed sampler latents -> a stock ComfyUI LATENT (raw VAE latents, (B, 16, 1, H/8, W/8), on the CPU)."""
    grid = sampler.family_sampler(comps).unpack(latents, cond.width, cond.height)
    return {"samples": encode.to_raw_latents(comps.vae, grid.to(next(comps.vae.parameters()).dtype)).float().cpu()}


STOCK_LATENT = "stock LATENT (raw Qwen-Image VAE latents): decodes with ComfyUI's VAE Decode and its Qwen-Image VAE"


class QwenEditSampler:
    """Edit an image (1 to 3 for Edit Plus; Qwen-Image-2.1: up to 10 ordered references, the image batch then the
    references input) with true CFG. One CFG device: cond and uncond batched; two devices: both branches at once,
    the uncond one on a replica on `uncond_device`."""

    CATEGORY = f"{CATEGORY}/sampling"
    SEARCH_ALIASES = ["ksampler", "sample", "image edit", "true cfg", "generate"]
    DESCRIPTION = ("Edits the control image following the prompt, with true CFG (cond and uncond branches). "
                   "Put the uncond branch on a second GPU with uncond_device, or run the transformer on every "
                   "GPU at once with parallel. Qwen-Image-2.1: every picture of the image batch, then the "
                   "references input, is a reference (up to 10, in order); use CFG 1 (the model is "
                   "CFG-distilled); the mask output is the picture's transparency.")
    RETURN_TYPES = ("IMAGE", "LATENT", "MASK")  # outputs are added last
    RETURN_NAMES = ("image", "latent", "mask")
    OUTPUT_TOOLTIPS = ("the edited image", STOCK_LATENT,
                       "1 - alpha of the picture (Qwen-Image-2.1 decodes RGBA); zeros for opaque models")
    FUNCTION = "sample"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": MODEL_IN, "image": IMAGE_IN, "prompt": PROMPT, "negative_prompt": NEGATIVE, "steps": STEPS,
            "true_cfg_scale": CFG, "seed": SEED, "width": _size("width"), "height": _size("height"),
            "shift_mode": SHIFT, "uncond_device": UNCOND, "vae_side": VAE_SIDE,
        }, "optional": {**EXTRA_IMAGES, "schedule": SCHEDULE, "shift": SHIFT_VALUE,
                         "control_size": (["pipeline", "target"], {
            "tooltip": "target: controls resized to the output size, which is the first control's own size when "
                       "a multiple of 16 (no rescale); for LoRAs trained with control_size target (pixel-aligned "
                       "pairs). pipeline: as diffusers"}), "parallel": PARALLEL,
                         "sigmas": SIGMAS, "references": REFERENCES_IN},
            "hidden": {"unique_id": "UNIQUE_ID"}}

    def sample(self, model, image, prompt, negative_prompt, steps, true_cfg_scale, seed, width, height, shift_mode,
               uncond_device, vae_side, image2=None, image3=None, unique_id=None, schedule="diffusers", shift=0.0,
               control_size="pipeline", parallel=False, sigmas="", references=None):
        loaded_models.use(model)
        family = variants.get(model.components.variant).family
        with torch.inference_mode(False), torch.no_grad():
            settings = _settings(steps, cfg_of(true_cfg_scale, model, schedule, sigmas), seed, width, height,
                                 shift_mode, negative_prompt, vae_area=side_of(vae_side, model), schedule=schedule,
                                 shift=shift,
                                 control_size=control_size,
                                 sigmas=sigmas)
            if family.ordered_references:
                _check_one_device(family, uncond_device, parallel)
                pictures = [p for img in (image, image2, image3) if img is not None
                            for p in reference_sampling.rgba_pictures(img)]
                return reference_sampling.run(model, prompt, pictures + list(references or ()), settings, unique_id,
                                              preview_due)
            if references:
                raise ValueError("references are Qwen-Image-2.1's; this model takes its control images through "
                                 "image, image2 and image3")
            controls = _controls(model, image, image2, image3)
            cond = sampler.build_conditioning(model.components, prompt, controls, settings)
            picture, latent = _run(model, cond, settings, uncond_device, unique_id, parallel)
            return (picture, latent, torch.zeros(picture.shape[:3]))


def _check_one_device(family, uncond_device: str, parallel: bool) -> None:
    """Refuse the multi-GPU settings a references family's loop does not have, naming what to set."""
    if parallel or uncond_device != "same":
        raise ValueError(f"{family.file_title} samples on its model's device (its prefix cache and block-causal "
                         "layout are not split across devices yet): set uncond_device to same and parallel off")


class QwenEditEncodePrompt:
    """Prompt + negative prompt + control image(s) -> conditioning for QwenEditSampleConditioning."""

    CATEGORY = f"{CATEGORY}/encode"
    SEARCH_ALIASES = ["encode prompt", "text encode", "conditioning", "clip text encode"]
    DESCRIPTION = ("Encodes the edit prompt, negative prompt and control image(s) once, for Sample "
                   "Conditioning.")
    RETURN_TYPES = (CONDITIONING,)
    RETURN_NAMES = ("conditioning",)
    FUNCTION = "encode"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": MODEL_IN, "image": IMAGE_IN, "prompt": PROMPT, "negative_prompt": NEGATIVE,
                             "width": _size("width"), "height": _size("height"), "vae_side": VAE_SIDE},
                "optional": dict(EXTRA_IMAGES)}

    def encode(self, model, image, prompt, negative_prompt, width, height, vae_side, image2=None, image3=None):
        settings = _settings(width=width, height=height, negative=negative_prompt,
                             vae_area=side_of(vae_side, model))
        loaded_models.use(model)
        with torch.inference_mode(False), torch.no_grad():
            controls = _controls(model, image, image2, image3)
            return (sampler.build_conditioning(model.components, prompt, controls, settings),)


class QwenEditSampleConditioning:
    """Sample from conditioning encoded once by Encode Prompt + Image (change steps, CFG or seed without
    re-encoding)."""

    CATEGORY = f"{CATEGORY}/sampling"
    SEARCH_ALIASES = ["sample conditioning", "ksampler", "sample from conditioning"]
    DESCRIPTION = ("Samples an edit from conditioning made by Encode Prompt + Image (change steps, CFG or "
                   "seed without encoding again).")
    RETURN_TYPES = ("IMAGE", "LATENT")  # the LATENT came later: outputs are added last
    RETURN_NAMES = ("image", "latent")
    OUTPUT_TOOLTIPS = ("the edited image", STOCK_LATENT)
    FUNCTION = "sample"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": MODEL_IN,
                             "conditioning": (CONDITIONING, {"tooltip": "from Encode Prompt + Image"}),
                             "steps": STEPS, "true_cfg_scale": CFG, "seed": SEED, "shift_mode": SHIFT,
                             "uncond_device": UNCOND},
                "optional": {"schedule": SCHEDULE, "shift": SHIFT_VALUE, "parallel": PARALLEL, "sigmas": SIGMAS},
                "hidden": {"unique_id": "UNIQUE_ID"}}

    def sample(self, model, conditioning, steps, true_cfg_scale, seed, shift_mode, uncond_device, unique_id=None,
               schedule="diffusers", shift=0.0, parallel=False, sigmas=""):
        settings = _settings(steps, cfg_of(true_cfg_scale, model, schedule, sigmas), seed, shift_mode=shift_mode,
                             schedule=schedule, shift=shift, sigmas=sigmas)
        loaded_models.use(model)
        if conditioning.uncond is None and settings.do_cfg:
            settings = dataclasses.replace(settings, negative_prompt=None)
        with torch.inference_mode(False), torch.no_grad():
            return _run(model, conditioning, settings, uncond_device, unique_id, parallel)


class QwenEditEncodeImage:
    """Image(s) -> Qwen-Image VAE latents (normalized, 16 channels, 1/8 of the size)."""

    CATEGORY = f"{CATEGORY}/encode"
    SEARCH_ALIASES = ["vae encode", "encode image", "image to latent"]
    DESCRIPTION = ("Encodes images with the model's VAE: latent for Decode Latent, and samples, a stock LATENT "
                   "that ComfyUI's VAE Decode with the Qwen-Image VAE decodes to the same picture.")
    RETURN_TYPES = (LATENT, "LATENT")
    RETURN_NAMES = ("latent", "samples")
    OUTPUT_TOOLTIPS = ("normalized latents for Decode Latent", STOCK_LATENT)
    FUNCTION = "encode"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": MODEL_IN, "image": ("IMAGE", {"tooltip": "the image(s) to encode"}),
                             "vae_side": VAE_SIDE}}

    def encode(self, model, image, vae_side):
        comps = model.components
        comps.require("vae")
        loaded_models.use(comps.vae)
        with torch.inference_mode(False), torch.no_grad():
            latents = []
            for pil in image_to_pils(image):
                size = encode.image_size_at_area(pil, side_of(vae_side, model) ** 2)
                latents.append(encode.encode_latents(comps.vae, encode.pixels_for_vae(pil, *size)))
            raw = torch.cat([encode.to_raw_latents(comps.vae, x) for x in latents])  # one IMAGE: one size
            return (latents, {"samples": raw.float().cpu()})


class QwenEditDecodeLatent:
    """Latents of Encode Image, or a stock LATENT, -> images, through the model's VAE."""

    CATEGORY = f"{CATEGORY}/encode"
    SEARCH_ALIASES = ["vae decode", "decode latent", "latent to image"]
    DESCRIPTION = ("Decodes latents of Encode Image, or a stock LATENT of Qwen-Image VAE latents (VAE Encode, "
                   "the Sampler's latent), into images with the model's VAE.")
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("image",)
    FUNCTION = "decode"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": MODEL_IN},
                "optional": {"latent": (LATENT, {"tooltip": "from Encode Image (or connect samples instead)"}),
                             "samples": ("LATENT", {"tooltip": "a stock LATENT of Qwen-Image VAE latents (VAE "
                                                               "Encode, our Sampler or Encode Image); used "
                                                               "when latent is not connected"})}}

    def decode(self, model, latent=None, samples=None):
        comps = model.components
        comps.require("vae")
        loaded_models.use(comps.vae)
        if latent is None and samples is None:
            raise ValueError("Decode Latent: connect latent (Encode Image) or samples (a stock LATENT)")
        with torch.inference_mode(False), torch.no_grad():
            if latent is None:
                latent = list(encode.from_raw_latents(comps.vae, samples["samples"]).split(1))
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
    SEARCH_ALIASES = ["fp8", "torch compile", "attention", "speed up sampling", "sage attention"]
    DESCRIPTION = ("Faster sampling: fp8 matmuls (Ada/Hopper GPUs), compiled blocks and the attention "
                   "kernel. Returns a new model; the input model is left as it is.")
    RETURN_TYPES = (MODEL,)
    RETURN_NAMES = ("model",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": MODEL_IN,
            "fp8": ("BOOLEAN", {"default": False, "tooltip": "e4m3 block weights, fp8 matmuls (Ada/Hopper): "
                                                             "faster linears (BENCHMARKS.md). Converting never holds "
                                                             "both forms on the GPU: each bf16 block weight goes to "
                                                             "host RAM as its fp8 copy is made (peak about the bf16 "
                                                             "model's size, then about half: BENCHMARKS.md, \"Sampling "
                                                             "Speed fp8\"); the input model gets them back when a "
                                                             "node uses it, so host RAM must hold the block weights' "
                                                             "bf16 size. LoRAs stay bf16"}),
            "compile": ("BOOLEAN", {"default": False, "tooltip": "compile each block once, on first "
                                                                 "use (compile time: BENCHMARKS.md)"}),
            "attention": (list(speed.SDPA_KERNELS), {"tooltip": "cudnn: fastest on Hopper GPUs"}),
        }}

    def apply(self, model, fp8, compile, attention):
        transformer = model.components.transformer
        jobs.REGISTRY.check_free(transformer, "apply speed levers")
        loaded_models.use(transformer)
        device = next(transformer.parameters()).device
        if not fp8 and not compile:  # nothing to change in the weights: share the transformer itself
            return (dataclasses.replace(model, attention=attention),)
        with torch.inference_mode(False):
            fresh = speed.inference_copy(transformer, device, fp8=fp8, compile=compile)
        components = dataclasses.replace(model.components, transformer=fresh)
        return (dataclasses.replace(model, components=components, replicas={}, attention=attention),)
