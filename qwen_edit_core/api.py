"""QwenImageEditTrainer: the seeds' API over the core's stages.

A thin object that holds the config, the device plan and the loaded components (with the trained LoRA's spec,
the loaded adapters and the split-CFG replica) between calls, and delegates every method to a stage function:
sample.predict and sample.sampler (predict, encoders), train.run (cache, fit, training_step), adapters.lora
(LoRA files, merge). It owns no maths of its own.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

import torch

from qwen_edit_core import preflight
from qwen_edit_core.adapters import lora as lora_mod
from qwen_edit_core.common.files import OutputLock
from qwen_edit_core.config import Config
from qwen_edit_core.model.components import (Components, detect_variant, load_components, model_identity,
                                             resolve_model_dir)
from qwen_edit_core.families import variants
from qwen_edit_core.model.devices import DevicePlan, resolve_device
from qwen_edit_core.families.templates import EMPTY_PROMPT
from qwen_edit_core.sample import predict as predict_mod
from qwen_edit_core.sample import sampler
from qwen_edit_core.train import run

log = logging.getLogger(__name__)


def doctor_dataset(folder, held_out=None, *, pixel_aligned: bool = False, area: int | None = None,
                   batch_size: int = 1, out_dir=None, fix_dir=None, cache_dir=None, workers: int = 1,
                   text_encoder=None, model=None, comfyui_dir=None, count_tokens=None):
    """The dataset doctor on a folder of pairs (qwen_edit_core.data.doctor): returns its DoctorRun (report, report
    picture, fixes applied). `held_out`: the held-out pairs as `train.validation_pairs` takes them (a number N: the
    folder's last N pairs; a folder); `pixel_aligned`: the edit keeps every pixel in place (realign with
    `fix_dir`); `area`, `batch_size`: the training's data.vae_area and data.batch_size, for the size checks;
    `out_dir`: where report.txt and report.png go; `fix_dir`: a new folder for the fixed copy; `cache_dir`: where
    the measures are kept by content hash; `workers`: processes reading and measuring; `text_encoder`: an already
    loaded TextEncoder (`load_text_encoder`) asked whether each target shows its caption's edit (optional: nothing
    is loaded for it). The captions' tokens are counted by `count_tokens`, else by the tokenizer of `model` or
    `comfyui_dir` (`doctor_tokenizer`). Each picture is read and decoded once: the doctor measures it from the
    dataset reader's decode."""
    from qwen_edit_core.data.dataset import load_dataset
    from qwen_edit_core.data.doctor import DoctorSettings, doctor_folder
    from qwen_edit_core.data.doctor.runner import PairMeasurer
    from qwen_edit_core.train.heldout import split_heldout
    settings = DoctorSettings(area=area, pixel_aligned=pixel_aligned, batch_size=batch_size)
    with PairMeasurer(cache_dir, workers) as measured:  # its helper processes end however the run does

        def read(path):
            return load_dataset(path, skip_invalid=True, convert_modes=True, on_pair=measured).examples

        examples, held = list(read(folder)), []
        if held_out:
            examples, held = split_heldout(examples, held_out, read)
        return doctor_folder(folder, examples, held, settings, out_dir=out_dir, fix_dir=fix_dir, workers=workers,
                             text_encoder=text_encoder, measured=measured,
                             count_tokens=count_tokens or doctor_tokenizer(model, comfyui_dir))


def doctor_tokenizer(model=None, comfyui_dir=None):
    """`count(text) -> tokens` of the text encoder's tokenizer for the doctor's caption check, from what the user
    has, never downloading: `model` a diffusers model directory (or a hub id already in the local cache; its
    processor/ or tokenizer/), a folder of tokenizer files, or a text-encoder file (then ComfyUI's bundled
    tokenizer, in `comfyui_dir` or beside the file's models folder); or `comfyui_dir` alone. None when none is given
    or holds a tokenizer; a `model` that is neither raises ModelNotFoundError."""
    from qwen_edit_core.model import components as comp
    path = Path(str(model)).expanduser() if model else None
    if path is not None and path.is_file():
        path, comfyui_dir = None, comfyui_dir or comp.comfyui_dir_near(path.parent.parent)
    elif path is not None and (path / "tokenizer_config.json").is_file():
        return comp.token_counter(path)
    elif path is not None:
        path = comp.resolve_model_dir(model)
        if not (path / "processor").is_dir() and (path / "tokenizer" / "tokenizer_config.json").is_file():
            return comp.token_counter(path / "tokenizer")
    return comp.caption_token_counter(path, comfyui_dir) if path is not None or comfyui_dir else None


def doctor_text_encoder(model=None, *, text_encoder_file=None, comfyui_dir=None, device: str = "cpu"):
    """The text encoder the doctor's optional vision-language check asks (data/doctor/vlm.py), from local files only:
    `model` a diffusers model directory (or a hub id already in the local cache) or a text-encoder file (its
    tokenizer: ComfyUI's bundled one, in `comfyui_dir` or beside the file's models folder); float32 on the CPU,
    bfloat16 elsewhere."""
    from qwen_edit_core.model import components as comp
    from qwen_edit_core.model.components import load_text_encoder
    path = Path(str(model)).expanduser() if model else None
    model_dir = None
    if path is not None and path.is_file():
        text_encoder_file, comfyui_dir = path, comfyui_dir or comp.comfyui_dir_near(path.parent.parent)
    elif model:
        model_dir = resolve_model_dir(model)
    if model_dir is None and not text_encoder_file:
        raise ValueError("the vision-language check needs the model's text encoder: give the model directory or a "
                         "text-encoder file (qwen-edit doctor --model), or a training --config")
    where = resolve_device(device, component="the doctor's text encoder device")
    return load_text_encoder(model_dir, device=where, dtype=torch.float32 if where.type == "cpu" else torch.bfloat16,
                             text_encoder_file=text_encoder_file, comfyui_dir=comfyui_dir)


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
        self._cfg_split = None  # this process's CFG branch under context parallelism (cfg_mode split)
        self._predict_ready = False

    # -- loading -----------------------------------------------------------------------------------------
    def load_model(self, which: Sequence[str] = ("transformer", "vae", "text_encoder"), *,
                   keep_transformer: bool = False) -> Components:
        """Load the named components on the plan's devices (`model.pretrained_model_name_or_path`).

        `keep_transformer=True` keeps the current (for example just trained) transformer and loads the rest.
        """
        kept = self.components.transformer if keep_transformer and self.components is not None else None
        which = tuple(w for w in which if not (kept is not None and w == "transformer"))
        weights = predict_mod.sampling_plan(self.plan.transformer, self.plan.dtype, self.config.predict) \
            if "transformer" in which else None  # fp8 decided before the weights load
        self.components = load_components(self.config.model.pretrained_model_name_or_path, self.plan, which=which,
                                          quantize_transformer=self.config.model.quantize, transformer_plan=weights,
                                          **self.model_files())
        if kept is not None:
            self.components.transformer = kept
        self._uncond_transformer = None
        self._predict_ready = False
        return self.components

    def model_files(self) -> dict:
        """The single files and the ComfyUI installation of `model.*`, as load_components takes them
        (train.run.model_files)."""
        return run.model_files(self.config)

    def setup_predict(self, replica: bool = True) -> None:
        """Ready the loaded components for sampling (sample.predict.prepare_transformer: eval mode, `predict.fp8` /
        `predict.compile` applied to the transformer in place, context parallelism); the uncond replica for split
        CFG unless `replica=False` (CFG off: nothing to split) or the CFG branches run on their own processes
        (context parallelism). `predict` calls it on first use."""
        self._cfg_split = predict_mod.prepare_transformer(self._require(), self.plan.transformer,
                                                          self.config.predict)
        self._predict_ready = True
        if self.config.predict.cfg_mode == "split" and replica and self._cfg_split is None:
            self._make_replica()

    def _make_replica(self) -> None:
        self._uncond_transformer = predict_mod.uncond_replica(self._require(), self.plan.transformer,
                                                              self.uncond_device)

    def _require(self) -> Components:
        if self.components is None:
            raise RuntimeError("no model loaded: call load_model() first")
        return self.components

    # -- sampling ----------------------------------------------------------------------------------------
    def predict(self, prompt_image, prompt: str, negative_prompt: str | None = EMPTY_PROMPT,
                num_inference_steps: int | None = None, true_cfg_scale: float | None = None, seed: int | None = None,
                height: int | None = None, width: int | None = None, output_type: str = "np", *,
                schedule: str | None = None, shift: float | None = None, progress=None, cancel=None,
                sigmas=None):
        """Edit `prompt_image` (a PIL/array image, or a list of them for Edit Plus) by `prompt`.

        `schedule` / `shift`: a named schedule (sample/schedules.py) and shift override, default
        `predict.schedule` / `predict.shift`. Steps and CFG not given: the schedule's (lightning: 4 and 1.0),
        else `predict.num_inference_steps` / `predict.true_cfg_scale`. `sigmas`: an explicit sigma list or preset
        name (sample/schedules.py SIGMA_PRESETS), default `predict.sigmas`; its length is the step count.

        Returns float32 (H, W, 3) in [0, 1] (`output_type="np"`), a PIL image (`"pil"`) or a torch tensor
        (`"pt"`, (1, H, W, 3)).
        """
        predict_mod.check_output_type(output_type)
        comps = self._require()
        settings = predict_mod.settings(self.config.predict, schedule=schedule, shift=shift,
                                        num_inference_steps=num_inference_steps, true_cfg_scale=true_cfg_scale,
                                        negative_prompt=negative_prompt, seed=seed, width=width, height=height,
                                        sigmas=sigmas)
        if not self._predict_ready:
            self.setup_predict(replica=settings.do_cfg)
        elif settings.do_cfg and settings.cfg_mode == "split" and self._uncond_transformer is None \
                and self._cfg_split is None:
            self._make_replica()
        images = list(prompt_image) if isinstance(prompt_image, (list, tuple)) else [prompt_image]
        image = sampler.sample(comps, prompt, images, settings, uncond_transformer=self._uncond_transformer,
                               cfg_split=self._cfg_split, progress=progress, cancel=cancel)
        return predict_mod.to_output(image, output_type)

    # -- encoders ----------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str, image, area: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt_embeds (1, S, D), mask (1, S)) for a prompt and its control image(s), on the TE device."""
        p = self.config.predict
        return predict_mod.encode_prompt(self._require(), prompt, image, area=area, vae_area=p.vae_area,
                                         vl_area=p.vl_area)

    def encode_image(self, image, area: int | None = None) -> torch.Tensor:
        """Normalized VAE latents (1, C, 1, h, w) of an image at `area` (default predict.vae_area); RGBA and sized as
        a reference for Qwen-Image-2.1."""
        return predict_mod.encode_image(self._require(), image, area or self.config.predict.vae_area)

    def decode_vae_latent(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents (B, 16, 1, h, w) -> (B, H, W, 3) float32 in [0, 1]."""
        return predict_mod.decode(self._require(), latents)

    # -- training ------------------------------------------------------------------------------------------
    def dataset(self):
        """The validated dataset of `data.folder` (all problems at once, or skipped with data.skip_invalid), the
        captions' tokens counted by the model's tokenizer (train.run.load_examples)."""
        return run.load_examples(self.config)

    def encode_settings(self, variant: str):
        """How examples are encoded for `variant` (train.run.encode_settings)."""
        return run.encode_settings(self.config, variant)

    def _cache(self):
        return run.open_cache(self.config)

    def _identity(self, model_dir: Path) -> str:
        """The encoders' identity in cache keys (train.run.cache_identity)."""
        return run.cache_identity(self.config, model_dir)

    def cache(self, examples=None, *, progress=None, cancel=None) -> dict:
        """The cache stage (train.run.run_cache): encode every example missing from the cache, with the loaded
        encoders or ones loaded on `cache.text_encoder_device` / `cache.vae_encoder_device`, then free them."""
        examples = list(examples if examples is not None else self.dataset().examples)
        folder, key = preflight.cache_dir(self.config)
        preflight.check_output_dir(folder, 0, "the embedding cache", key)  # before the encoders load
        return run.run_cache(self.config, examples, self.components, progress=progress, cancel=cancel)

    def check_fit(self, resume=None, overwrite: bool = False) -> None:
        """Preflight of `fit` without loading any weight: config devices, dataset, resume checkpoint, output
        directory (writable, free space), the LoRA to continue from (qwen_edit_core.preflight):
        `check_fit_inputs`, then `check_fit_outputs`."""
        self.check_fit_inputs(resume, overwrite)
        self.check_fit_outputs()

    def check_fit_inputs(self, resume=None, overwrite: bool = False) -> None:
        """The part of `check_fit` that writes nothing (the model first, then the dataset, the devices, the resume
        checkpoint, another run's files in the output folder, the weight files, previews and LoRA files): it may
        run before the output folder exists."""
        from qwen_edit_core.train.loop import resolve_resume
        from qwen_edit_core.train.run_folder import check_free
        examples = self.dataset().examples
        run.encoder_plan(self.config)
        out_dir = Path(self.config.train.output_dir)
        checkpoint = resolve_resume(out_dir, resume)
        check_free(out_dir, checkpoint, overwrite)
        preflight.training_inputs(self.config, resolve_model_dir(self.config.model.pretrained_model_name_or_path),
                                  len(examples), checkpoint)

    def check_fit_outputs(self) -> None:
        """The part of `check_fit` that writes: every folder the run writes, created and probed, the output
        directory with room for the run's files (preflight.training_outputs)."""
        preflight.training_outputs(self.config, resolve_model_dir(self.config.model.pretrained_model_name_or_path))

    def check_predict(self, loras=(), out_file=None, *, num_inference_steps: int | None = None,
                      true_cfg_scale: float | None = None,
                      width: int | None = None, height: int | None = None, images=None,
                      prompts: dict[str, str] | None = None) -> None:
        """Preflight of sampling without loading any weight: the sampling settings, the control `images` (how
        many the model takes, the image limits), the `prompts` ({what: text}: at most the text encoder's 1,024
        tokens, counted by the tokenizer alone), the LoRA files (readable, finite, matching the transformer) and
        the output file's folder (writable)."""
        predict_mod.settings(self.config.predict, schedule=None, shift=None, num_inference_steps=num_inference_steps,
                             true_cfg_scale=true_cfg_scale, negative_prompt="", seed=None, width=width,
                             height=height).validate()
        model_dir = resolve_model_dir(self.config.model.pretrained_model_name_or_path)
        variant = self.config.model.variant
        if not variant and model_dir is not None and (Path(model_dir) / "model_index.json").is_file():
            variant = detect_variant(model_dir)
        if images is not None:
            sampler.check_controls(images, variant)
        if variant and variants.get(variant).drop is None:
            prompts = None  # Qwen-Image-2.1's encoder (families/qwen_image_21/encode.py) sets no such limit
        preflight.sampling(model_dir, loras, out_file, self.config, prompts)

    def fit(self, *, resume=None, progress=None, cancel=None, lock=None, shared: Components | None = None,
            overwrite: bool = False):
        """Train a LoRA on `data.folder` (from the cache when `cache.enabled`, else encoding in real time) and
        write it to `train.output_dir` (train.run.fit); returns loop.TrainResult. The trained transformer and
        its LoRA stay loaded (save_lora, predict).

        Everything checkable is checked before any weight loads (qwen_edit_core.preflight). One writer per output
        directory: the run holds an OutputLock on `train.output_dir` until it ends (or uses `lock`, one the caller
        holds); a second run there is refused at once with OutputDirBusyError naming the holder's PID and start
        time. `shared`: loaded components to train on instead of loading a transformer (the caller keeps them;
        the trained adapter is taken off their transformer when the run ends: train.run.fit). A new run into a
        folder holding another run's LoRA or checkpoints is refused (OutputDirTakenError) unless `overwrite`,
        which moves the old run aside first (train.run_folder)."""
        if (lock is not None and lock.held) or os.environ.get("RANK", "0") != "0":  # other ranks: rank 0 holds it
            return self._fit(resume, progress, cancel, shared, overwrite)
        if shared is None:  # a config with no usable model is refused before the lock creates the output folder
            resolve_model_dir(self.config.model.pretrained_model_name_or_path)
        with OutputLock(self.config.train.output_dir):
            return self._fit(resume, progress, cancel, shared, overwrite)

    def _fit(self, resume, progress, cancel, shared=None, overwrite=False):
        def release() -> None:
            self.components = None

        def ready(comps: Components, spec) -> None:
            self.components, self._spec = comps, spec

        def check(model_dir: Path, n_examples: int) -> None:
            from qwen_edit_core.train.loop import resolve_resume
            checkpoint = resolve_resume(Path(self.config.train.output_dir), resume)
            preflight.training(self.config, model_dir, n_examples, checkpoint)

        result = run.fit(self.config, encoders=self.components, shared=shared, release=release, ready=ready,
                         check=check, resume=resume, progress=progress, cancel=cancel, overwrite=overwrite)
        self._uncond_transformer = None
        return result

    def training_step(self, items: Sequence, *, step: int = 0) -> torch.Tensor:
        """The loss of one batch, dispatched by content (the seeds' `training_step`, train.run.batch_loss): items
        that hold cached tensors (dicts from the cache) train from them; dataset examples (`EditExample`) are
        encoded in real time by the loaded text encoder and VAE."""
        return run.batch_loss(self.config, self._require(), items, step=step)

    # -- LoRA files ----------------------------------------------------------------------------------------
    def save_lora(self, path) -> Path:
        """Write the trained LoRA (ComfyUI + diffusers compatible keys, metadata) to `path`."""
        comps = self._require()
        spec = getattr(self, "_spec", None)
        if spec is None:
            raise RuntimeError("no LoRA to save: train one (fit) or load one (load_lora) first")
        path = Path(path)
        lora_mod.save_lora(path, comps.transformer, spec, steps=0,
                           base_identity=model_identity(comps.model_dir, comps.variant))
        return path

    def load_lora(self, path, scale: float = 1.0, adapter_name: str | None = None) -> str:
        """Load a LoRA file (any layout lora.read_lora_file reads) onto the transformer with a strength."""
        comps = self._require()
        comps.require("transformer")
        name = adapter_name or f"lora_{len(getattr(self, '_adapters', {}))}"
        lora_mod.load_lora_file(comps.transformer, path, adapter_name=name, strength=scale)
        self._adapters = {**getattr(self, "_adapters", {}), name: scale}
        self._uncond_transformer = None
        return name

    def merge_lora(self) -> None:
        lora_mod.merge_lora(self._require().transformer)
        self._uncond_transformer = None

    def unmerge_lora(self) -> None:
        lora_mod.unmerge_lora(self._require().transformer)
        self._uncond_transformer = None
