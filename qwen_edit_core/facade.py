"""QwenImageEditTrainer: the seeds' API over the core's stages.

A thin object that holds the config and the loaded components and calls the stage functions (encode,
sampler, ...). It owns no maths of its own.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from . import encode, sampler
from .components import Components, load_components, replicate
from .config import Config
from .devices import DevicePlan, resolve_device

log = logging.getLogger(__name__)


class QwenImageEditTrainer:
    """Load a Qwen-Image-Edit model on a device plan, then predict (and, later stages, cache and fit)."""

    def __init__(self, config: Config):
        self.config = config
        predict = config.predict
        # Validate every device before any weight is loaded.
        self.plan = DevicePlan.from_mapping(
            {"text_encoder": predict.devices.text_encoder, "vae": predict.devices.vae,
             "transformer": predict.devices.transformer}, dtype=predict.dtype)
        self.uncond_device = resolve_device(predict.uncond_device, component="predict.uncond_device") \
            if predict.uncond_device else None
        self.components: Components | None = None
        self._uncond_transformer = None

    # -- loading -----------------------------------------------------------------------------------------
    def load_model(self, which: Sequence[str] = ("transformer", "vae", "text_encoder")) -> Components:
        """Load the named components on the plan's devices (`model.pretrained_model_name_or_path`)."""
        self.components = load_components(self.config.model.pretrained_model_name_or_path, self.plan, which=which,
                                          quantize_transformer=self.config.model.quantize)
        self._uncond_transformer = None
        return self.components

    def setup_predict(self) -> None:
        """Ready the loaded components for sampling (eval mode; the uncond replica for split CFG)."""
        comps = self._require()
        comps.transformer.eval()
        if self.config.predict.cfg_mode == "split":
            device = self.uncond_device or self.plan.transformer
            self._uncond_transformer = replicate(comps.transformer, device)

    def _require(self) -> Components:
        if self.components is None:
            raise RuntimeError("no model loaded: call load_model() first")
        return self.components

    # -- sampling ----------------------------------------------------------------------------------------
    def predict(self, prompt_image, prompt: str, negative_prompt: str | None = "", num_inference_steps: int = 20,
                true_cfg_scale: float = 4.0, seed: int | None = None, height: int | None = None,
                width: int | None = None, output_type: str = "np", *, progress=None, cancel=None):
        """Edit `prompt_image` (a PIL/array image, or a list of them for Edit Plus) by `prompt`.

        Returns float32 (H, W, 3) in [0, 1] (`output_type="np"`), a PIL image (`"pil"`) or a torch tensor
        (`"pt"`, (1, H, W, 3)).
        """
        if output_type not in ("np", "pil", "pt"):
            raise ValueError(f"output_type {output_type!r} is not accepted; accepted: np, pil, pt")
        comps = self._require()
        p = self.config.predict
        settings = sampler.SampleSettings(
            num_inference_steps=num_inference_steps, true_cfg_scale=true_cfg_scale, negative_prompt=negative_prompt,
            seed=seed, width=width, height=height, cfg_mode=p.cfg_mode, shift_mode=p.shift_mode,
            fixed_mu=p.fixed_mu, vae_area=p.vae_area, vl_area=p.vl_area)
        if settings.do_cfg and settings.cfg_mode == "split" and self._uncond_transformer is None:
            self.setup_predict()
        images = list(prompt_image) if isinstance(prompt_image, (list, tuple)) else [prompt_image]
        image = sampler.sample(comps, prompt, images, settings, uncond_transformer=self._uncond_transformer,
                               progress=progress, cancel=cancel)
        if output_type == "pt":
            return image
        array = image[0].numpy().astype(np.float32)
        if output_type == "pil":
            return Image.fromarray((array * 255).round().astype(np.uint8))
        return array

    # -- encoders ----------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str, image, area: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt_embeds (1, S, D), mask (1, S)) for a prompt and its control image(s), on the TE device."""
        comps = self._require()
        comps.require("text_encoder")
        images = [encode.to_pil(i) for i in (image if isinstance(image, (list, tuple)) else [image])]
        area = area or (self.config.predict.vae_area if comps.variant == "edit" else self.config.predict.vl_area)
        vl = [encode.resize(i, *encode.image_size_at_area(i, area)) for i in images]
        te = comps.text_encoder
        (emb,) = encode.encode_prompts(te.model, te.processor, [prompt], [vl], comps.variant, device=te.device)
        embeds = encode.pad_embeddings([emb])
        return embeds.embeds, embeds.mask

    def encode_image(self, image, area: int | None = None) -> torch.Tensor:
        """Normalized VAE latents (1, 16, 1, h, w) of an image at `area` (default predict.vae_area)."""
        comps = self._require()
        comps.require("vae")
        pil = encode.to_pil(image)
        size = encode.image_size_at_area(pil, area or self.config.predict.vae_area)
        return encode.encode_latents(comps.vae, encode.pixels_for_vae(pil, *size))

    def decode_vae_latent(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents (B, 16, 1, h, w) -> (B, H, W, 3) float32 in [0, 1]."""
        comps = self._require()
        comps.require("vae")
        return encode.postprocess(encode.decode_latents(comps.vae, latents)).cpu()
