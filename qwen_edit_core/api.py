"""QwenImageEditTrainer: the seeds' API over the core's stages.

A thin object that holds the config and the loaded components and calls the stage functions (encode,
sampler, ...). It owns no maths of its own.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from qwen_edit_core.model import encode, variants
from qwen_edit_core.sample import sampler
from qwen_edit_core.model.components import Components, load_components, replicate
from qwen_edit_core.config import Config
from qwen_edit_core.model.devices import DevicePlan, resolve_device
from qwen_edit_core.model.templates import EMPTY_PROMPT

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
        self._predict_ready = False

    # -- loading -----------------------------------------------------------------------------------------
    def load_model(self, which: Sequence[str] = ("transformer", "vae", "text_encoder"), *,
                   keep_transformer: bool = False) -> Components:
        """Load the named components on the plan's devices (`model.pretrained_model_name_or_path`).

        `keep_transformer=True` keeps the current (for example just trained) transformer and loads the rest.
        """
        kept = self.components.transformer if keep_transformer and self.components is not None else None
        which = tuple(w for w in which if not (kept is not None and w == "transformer"))
        self.components = load_components(self.config.model.pretrained_model_name_or_path, self.plan, which=which,
                                          quantize_transformer=self.config.model.quantize, **self.model_files())
        if kept is not None:
            self.components.transformer = kept
        self._uncond_transformer = None
        self._predict_ready = False
        return self.components

    def model_files(self) -> dict:
        """The single files and the ComfyUI installation of `model.*`, as load_components takes them:
        transformer_file, vae_file, text_encoder_file (bare names are looked up in model.comfyui_models_dir),
        comfyui_dir (model.comfyui_dir, else the installation holding model.comfyui_models_dir, if it is one) and
        transformer_fp8."""
        from qwen_edit_core.model.components import comfyui_dir_near, resolve_model_file
        m = self.config.model
        files = {f"{name}_file": resolve_model_file(getattr(m, f"{name}_file"), name, m.comfyui_models_dir)
                 for name in ("transformer", "vae", "text_encoder")}
        comfyui = Path(m.comfyui_dir).expanduser() if m.comfyui_dir else comfyui_dir_near(m.comfyui_models_dir)
        return {**files, "comfyui_dir": comfyui, "transformer_fp8": m.transformer_fp8}

    def setup_predict(self, replica: bool = True) -> None:
        """Ready the loaded components for sampling: eval mode; `predict.fp8` / `predict.compile` applied to the
        transformer in place (qwen_edit_core.speed; it stays so until reloaded); the uncond replica for split
        CFG unless `replica=False` (CFG off: nothing to split). `predict` calls it on first use."""
        comps = self._require()
        comps.transformer.eval()
        p = self.config.predict
        if p.fp8 or p.compile:
            from qwen_edit_core import speed
            speed.configure_inference(comps.transformer, self.plan.transformer, fp8=p.fp8, compile=p.compile)
        if p.context_parallel > 1:
            if p.cfg_mode == "split":
                raise ValueError("predict.context_parallel with cfg_mode split: the two CFG branches on their own "
                                 "process groups are not built; use cfg_mode sequential or batched")
            from qwen_edit_core.sample import context_parallel
            context_parallel.enable(comps.transformer, p.context_parallel, p.cp_mode)
        self._predict_ready = True
        if self.config.predict.cfg_mode == "split" and replica:
            self._make_replica()

    def _make_replica(self) -> None:
        device = self.uncond_device or self.plan.transformer
        self._uncond_transformer = replicate(self._require().transformer, device)

    def _require(self) -> Components:
        if self.components is None:
            raise RuntimeError("no model loaded: call load_model() first")
        return self.components

    # -- sampling ----------------------------------------------------------------------------------------
    def predict(self, prompt_image, prompt: str, negative_prompt: str | None = EMPTY_PROMPT,
                num_inference_steps: int | None = None, true_cfg_scale: float | None = None, seed: int | None = None,
                height: int | None = None, width: int | None = None, output_type: str = "np", *,
                schedule: str | None = None, shift: float | None = None, progress=None, cancel=None):
        """Edit `prompt_image` (a PIL/array image, or a list of them for Edit Plus) by `prompt`.

        `schedule` / `shift`: a named schedule (sample/schedules.py) and shift override, default
        `predict.schedule` / `predict.shift`. Steps and CFG not given: the schedule's (lightning: 4 and 1.0),
        else `predict.num_inference_steps` / `predict.true_cfg_scale`.

        Returns float32 (H, W, 3) in [0, 1] (`output_type="np"`), a PIL image (`"pil"`) or a torch tensor
        (`"pt"`, (1, H, W, 3)).
        """
        if output_type not in ("np", "pil", "pt"):
            raise ValueError(f"output_type {output_type!r} is not accepted; accepted: np, pil, pt")
        comps = self._require()
        p = self.config.predict
        from qwen_edit_core.sample import schedules
        schedule = schedule or p.schedule
        steps, cfg = schedules.steps_and_cfg(schedule, num_inference_steps, true_cfg_scale, p.num_inference_steps,
                                             p.true_cfg_scale)
        settings = sampler.SampleSettings(
            num_inference_steps=steps, true_cfg_scale=cfg, negative_prompt=negative_prompt,
            seed=seed, width=width, height=height, cfg_mode=p.cfg_mode, shift_mode=p.shift_mode,
            fixed_mu=p.fixed_mu, vae_area=p.vae_area, vl_area=p.vl_area, attention=p.attention,
            schedule=schedule, shift=shift if shift is not None else p.shift,
            control_size=p.control_size)
        if not self._predict_ready:
            self.setup_predict(replica=settings.do_cfg)
        elif settings.do_cfg and settings.cfg_mode == "split" and self._uncond_transformer is None:
            self._make_replica()
        images = list(prompt_image) if isinstance(prompt_image, (list, tuple)) else [prompt_image]
        image = sampler.sample(comps, prompt, images, settings, uncond_transformer=self._uncond_transformer,
                               progress=progress, cancel=cancel)
        if output_type == "pt":
            return image
        array = image[0].numpy().astype(np.float32)
        if output_type == "pil":
            return Image.fromarray((array * 255).round().astype(np.uint8))
        return array

    def _settings(self, steps, cfg, negative_prompt, seed, width, height) -> sampler.SampleSettings:
        p = self.config.predict
        if not cfg >= 0:
            raise ValueError(f"true_cfg_scale must be >= 0, got {cfg}")
        return sampler.SampleSettings(
            num_inference_steps=steps, true_cfg_scale=cfg, negative_prompt=negative_prompt, seed=seed, width=width,
            height=height, cfg_mode=p.cfg_mode, shift_mode=p.shift_mode, fixed_mu=p.fixed_mu, vae_area=p.vae_area,
            vl_area=p.vl_area, attention=p.attention)

    # -- encoders ----------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str, image, area: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt_embeds (1, S, D), mask (1, S)) for a prompt and its control image(s), on the TE device."""
        comps = self._require()
        comps.require("text_encoder")
        images = [encode.to_pil(i) for i in (image if isinstance(image, (list, tuple)) else [image])]
        area = area or variants.get(comps.variant).vl_area(self.config.predict.vae_area, self.config.predict.vl_area)
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

    # -- training ------------------------------------------------------------------------------------------
    def dataset(self):
        """The validated dataset of `data.folder` (all problems at once, or skipped with data.skip_invalid)."""
        from qwen_edit_core.data.dataset import load_dataset
        d = self.config.data
        return load_dataset(d.folder, skip_invalid=d.skip_invalid, convert_modes=d.convert_modes)

    def encode_settings(self, variant: str):
        from qwen_edit_core.model.devices import resolve_dtype
        from qwen_edit_core.data.example_tensors import EncodeSettings
        d = self.config.data
        return EncodeSettings(variant=variant, vae_area=d.vae_area, vl_area=d.vl_area,
                              dtype=resolve_dtype(self.config.model.dtype, component="model.dtype"),
                              convert_modes=d.convert_modes, control_size=d.control_size)

    def _cache(self):
        from qwen_edit_core.data.cache import EmbeddingCache
        root = self.config.cache.dir or str(Path(self.config.train.output_dir) / "cache")
        return EmbeddingCache(Path(root))

    def _identity(self, model_dir: Path) -> str:
        """The encoders' identity in cache keys (the VAE and the text encoder may come from their own files, the
        processor from ComfyUI's bundled tokenizer)."""
        from qwen_edit_core.model.components import processor_source
        from qwen_edit_core.data.example_tensors import encoder_identity
        files = self.model_files()
        return encoder_identity(model_dir, files["vae_file"], files["text_encoder_file"],
                                processor_source(model_dir, files["comfyui_dir"]))

    def _encoder_plan(self) -> DevicePlan:
        c = self.config.cache
        from qwen_edit_core.train.loop import local_device
        return DevicePlan.from_mapping({"text_encoder": local_device(c.text_encoder_device),
                                        "vae": local_device(c.vae_encoder_device),
                                        "transformer": local_device(self.config.train.device)},
                                       dtype=self.config.model.dtype)

    def cache(self, examples=None, *, progress=None, cancel=None) -> dict:
        """The cache stage: encode every example missing from the cache (text encoder and VAE on
        `cache.text_encoder_device` / `cache.vae_encoder_device`), then free the encoders."""
        from qwen_edit_core.model.components import detect_variant, load_components, resolve_model_dir
        from qwen_edit_core.data.example_tensors import build_cache, cache_key
        examples = list(examples if examples is not None else self.dataset().examples)
        model_dir = resolve_model_dir(self.config.model.pretrained_model_name_or_path)
        settings = self.encode_settings(self.config.model.variant or detect_variant(model_dir))
        cache = self._cache()
        identity = self._identity(model_dir)
        # `contains` validates each entry's header, so a damaged one is recomputed in this same run.
        missing = [ex for ex in examples if not cache.contains(cache_key(ex, settings, identity))]
        if not missing:
            log.info("cache: all %d entries present in %s; encoders not loaded", len(examples), cache.root)
            return {"total": len(examples), "hits": len(examples), "computed": 0}
        comps = self.components
        if comps is None or comps.text_encoder is None or comps.vae is None:
            comps = load_components(model_dir, self._encoder_plan(), which=("vae", "text_encoder"),
                                    **self.model_files())
        return build_cache(comps, examples, cache, settings, identity=identity, progress=progress, cancel=cancel)

    def check_fit(self, resume=None) -> None:
        """Preflight of `fit` without loading any weight: config devices, dataset, resume checkpoint, output
        directory (writable, free space), the LoRA to continue from (qwen_edit_core.preflight)."""
        from qwen_edit_core import preflight
        from qwen_edit_core.model.components import resolve_model_dir
        from qwen_edit_core.train.loop import resolve_resume
        examples = self.dataset().examples
        self._encoder_plan()
        resolve_resume(Path(self.config.train.output_dir), resume)
        preflight.training(self.config, resolve_model_dir(self.config.model.pretrained_model_name_or_path),
                           len(examples))

    def check_predict(self, loras=(), out_file=None, *, num_inference_steps: int | None = None,
                      true_cfg_scale: float | None = None,
                      width: int | None = None, height: int | None = None) -> None:
        """Preflight of sampling without loading any weight: the sampling settings, the LoRA files (readable,
        finite, matching the transformer) and the output file's folder (writable)."""
        from qwen_edit_core import preflight
        from qwen_edit_core.model.components import resolve_model_dir
        p = self.config.predict  # None: the schedule's or the config's value, checked at load
        self._settings(p.num_inference_steps if num_inference_steps is None else num_inference_steps,
                       p.true_cfg_scale if true_cfg_scale is None else true_cfg_scale, "", None, width,
                       height).validate()
        preflight.sampling(resolve_model_dir(self.config.model.pretrained_model_name_or_path), loras, out_file)

    def fit(self, *, resume=None, progress=None, cancel=None, lock=None):
        """Train a LoRA on `data.folder` (from the cache when `cache.enabled`, else encoding in real time) and
        write it to `train.output_dir`; returns trainer.TrainResult.

        Everything checkable is checked before any weight loads (`check_fit`). One writer per output directory:
        the run holds an OutputLock on `train.output_dir` until it ends (or uses `lock`, one the caller holds);
        a second run there is refused at once with OutputDirBusyError naming the holder's PID and start time."""
        from qwen_edit_core.common.files import OutputLock
        if (lock is not None and lock.held) or os.environ.get("RANK", "0") != "0":  # other ranks: rank 0 holds it
            return self._fit(resume=resume, progress=progress, cancel=cancel)
        with OutputLock(self.config.train.output_dir):
            return self._fit(resume=resume, progress=progress, cancel=cancel)

    def _fit(self, *, resume=None, progress=None, cancel=None):
        from qwen_edit_core import preflight
        from qwen_edit_core.adapters import lora as lora_mod
        from qwen_edit_core.model.components import detect_variant, load_components, resolve_model_dir
        from qwen_edit_core.data.example_tensors import buckets, cache_key, encode_example
        from qwen_edit_core.train.loop import resolve_resume, train

        cfg = self.config
        report = self.dataset()
        examples = list(report.examples)
        model_dir = resolve_model_dir(cfg.model.pretrained_model_name_or_path)
        variant = cfg.model.variant or detect_variant(model_dir)
        settings = self.encode_settings(variant)
        out_dir = Path(cfg.train.output_dir)
        resume_path = resolve_resume(out_dir, resume)
        plan = self._encoder_plan()
        from qwen_edit_core.train.checkpoint import lora_stack
        stack = lora_stack(cfg.model.lora.stack, resume_path)
        n_controls = len(examples[0].controls)
        val_example = None
        if cfg.train.validation_every and cfg.train.validation_image:
            from qwen_edit_core.train.validation import validation_example
            val_example = validation_example(cfg.train.validation_image, cfg.train.validation_prompt, n_controls)
        preflight.training(cfg, model_dir, len(examples))
        if cfg.cache.enabled:
            self.cache(examples + ([val_example] if val_example else []), progress=progress, cancel=cancel)
            self.components = None  # free the encoders before the transformer loads
            comps = load_components(model_dir, plan, which=("transformer",), quantize_transformer=cfg.model.quantize,
                                    **self.model_files())
            cache, identity = self._cache(), self._identity(model_dir)
            keys = [cache_key(ex, settings, identity) for ex in examples]

            def load_item(i: int) -> dict:
                tensors = cache.get(keys[i])
                if tensors is None:
                    raise RuntimeError(f"cache entry of {examples[i].name} vanished from {cache.root}; run cache again")
                return tensors
        else:
            comps = load_components(model_dir, plan, quantize_transformer=cfg.model.quantize, **self.model_files())

            def load_item(i: int) -> dict:
                return encode_example(comps, examples[i], settings)
        validator = None
        if val_example is not None:
            from qwen_edit_core.train.validation import Validator, previews_from_config
            if cfg.cache.enabled:
                val_tensors = self._cache().get(cache_key(val_example, settings,
                                                          self._identity(model_dir)))
            else:
                val_tensors = encode_example(comps, val_example, settings)
            validator = Validator(comps, val_tensors, out_dir, previews_from_config(cfg), stack=stack)
        spec = lora_mod.LoraSpec(rank=cfg.model.lora.rank, alpha=cfg.model.lora.alpha,
                                 targets=lora_mod.resolve_targets(cfg.model.lora.targets),
                                 dropout=cfg.model.lora.dropout, init=cfg.model.lora.init)
        with torch.inference_mode(False):
            # LoRA init draws from torch's global RNG: seed it, so the run does not depend on what loaded before.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cfg.train.seed)
                lora_mod.inject_lora(comps.transformer, spec)
            if cfg.model.lora.init_from:
                lora_mod.load_lora_into(comps.transformer, lora_mod.read_lora_file(cfg.model.lora.init_from),
                                        adapter_name="default", strength=1.0)
            if stack:
                # companions: active and frozen; saved files and checkpoints hold only "default"
                lora_mod.activate_with_trained(comps.transformer, stack)
            self.components, self._spec = comps, spec
            identity_str = str(model_dir)

            def write_lora(path: Path, step: int) -> None:
                lora_mod.save_lora(path, comps.transformer, spec, base_identity=identity_str, steps=step)

            result = train(cfg, comps.transformer, load_item, examples,
                           [buckets(ex, settings) for ex in examples], scheduler_config=comps.scheduler_config,
                           write_lora=write_lora, out_dir=out_dir, resume=resume_path, progress=progress,
                           cancel=cancel, validate=validator)
        if validator is not None and validator.latent_files:
            # Training is over: a VAE may load now to turn the validation latents into images.
            vae = comps.vae or load_components(model_dir, plan, which=("vae",), **self.model_files()).vae
            result.validation_images = validator.decode_pending(vae)
        self._uncond_transformer = None
        return result

    def training_step(self, items: Sequence, *, step: int = 0) -> torch.Tensor:
        """The loss of one batch, dispatched by content (the seeds' `training_step`): items that hold cached
        tensors (dicts from the cache) train from them; dataset examples (`EditExample`) are encoded in real
        time by the loaded text encoder and VAE. Both give the same loss for the same batch and seed."""
        from qwen_edit_core.data.dataset import EditExample
        from qwen_edit_core.data.example_tensors import encode_example
        from qwen_edit_core.train.loop import collate, flow_loss, sample_generator
        from qwen_edit_core.adapters import multires
        comps = self._require()
        comps.require("transformer")
        multires.install(comps.transformer)
        settings = self.encode_settings(self.config.model.variant or comps.variant)
        tensors = [encode_example(comps, item, settings) if isinstance(item, EditExample) else item
                   for item in items]
        param = next(comps.transformer.parameters())
        gens = [sample_generator(self.config.train.seed, step, 0, j) for j in range(len(tensors))]
        batch = collate(tensors, gens, caption_dropout=self.config.data.caption_dropout_rate,
                        control_dropout=self.config.data.prompt_image_dropout_rate, device=param.device,
                        dtype=comps.transformer.img_in.weight.dtype)
        loss, _ = flow_loss(comps.transformer, batch, self.config, comps.scheduler_config)
        return loss

    # -- LoRA files ----------------------------------------------------------------------------------------
    def save_lora(self, path) -> Path:
        """Write the trained LoRA (ComfyUI + diffusers compatible keys, metadata) to `path`."""
        from qwen_edit_core.adapters import lora as lora_mod
        comps = self._require()
        spec = getattr(self, "_spec", None)
        if spec is None:
            raise RuntimeError("no LoRA to save: train one (fit) or load one (load_lora) first")
        path = Path(path)
        lora_mod.save_lora(path, comps.transformer, spec, base_identity=str(comps.model_dir), steps=0)
        return path

    def load_lora(self, path, scale: float = 1.0, adapter_name: str | None = None) -> str:
        """Load a LoRA file (any layout lora.read_lora_file reads) onto the transformer with a strength."""
        from qwen_edit_core.adapters import lora as lora_mod
        comps = self._require()
        comps.require("transformer")
        weights = lora_mod.read_lora_file(path)
        name = adapter_name or f"lora_{len(getattr(self, '_adapters', {}))}"
        with torch.inference_mode(False):
            lora_mod.load_lora_into(comps.transformer, weights, adapter_name=name, strength=scale)
        self._adapters = {**getattr(self, "_adapters", {}), name: scale}
        self._uncond_transformer = None
        return name

    def merge_lora(self) -> None:
        from qwen_edit_core.adapters import lora as lora_mod
        lora_mod.merge_lora(self._require().transformer)
        self._uncond_transformer = None

    def unmerge_lora(self) -> None:
        from qwen_edit_core.adapters import lora as lora_mod
        lora_mod.unmerge_lora(self._require().transformer)
        self._uncond_transformer = None
