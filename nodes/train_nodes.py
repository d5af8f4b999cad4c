"""Dataset, cache and training nodes. Training runs in a background job: the train node returns at once,
the status node waits (with a progress bar and the live loss) and turns ComfyUI's interrupt into a clean
stop with a checkpoint."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path

import torch

from qwen_edit_core import jobs
from qwen_edit_core import speed
from qwen_edit_core.config import load_config
from qwen_edit_core.data.dataset import load_dataset
from qwen_edit_core.adapters.lora import TARGET_PRESETS
from qwen_edit_core.common.names import check_file_name
from qwen_edit_core.common.progress import Cancelled, CancelToken
from qwen_edit_core.train.heldout import heldout_text
from qwen_edit_core.train.run_folder import OutputDirTakenError, previous_run
from qwen_edit_core.train.validation import parse_lora_lines, parse_previews

from . import comfy_runtime, loaded_models
from .job_service import outcome
from .common import (CATEGORY, DATASET, JOB, MODEL, TIPS, DatasetHandle, files_to_image, image_to_pils,
                     auto_cfg, side_of, training_defaults)

log = logging.getLogger(__name__)

OVERWRITE = ("BOOLEAN", {"default": False, "tooltip": "a second run under a lora_name that was trained before: "
                         "on, the old run's LoRA and checkpoints are moved aside (output/qwen_edit_runs/NAME."
                         "replaced-<time>) and training starts anew; off, such a run is refused (turn resume on to "
                         "continue the old run instead)"})
RESOLUTION = ("INT", {"default": 0, "min": 0, "max": 2048, "step": 32,
                      "tooltip": "training side in pixels: images are resized to about this side squared; 0 (auto): "
                                 "the model's own size (1024 native for real models; 128 for the built-in toy "
                                 "ones); 512 has a quarter of 1024's image tokens"})


def _folder(folder: str) -> Path:
    """An absolute folder, or one relative to ComfyUI's input directory."""
    path = Path(folder.strip()).expanduser()
    return path if path.is_absolute() else comfy_runtime.input_dir() / path


class QwenEditDataset:
    """A folder of edit pairs, validated: every problem is listed (or skipped with skip_invalid)."""

    CATEGORY = f"{CATEGORY}/training"
    SEARCH_ALIASES = ["dataset", "load dataset", "image pairs folder", "training data"]
    DESCRIPTION = ("Reads and checks a folder of before/after edit pairs (with prompts) for training; lists "
                   "every problem it finds.")
    RETURN_TYPES = (DATASET, "STRING")
    RETURN_NAMES = ("dataset", "summary")
    FUNCTION = "load"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"folder": ("STRING", {"default": "my_edit_pairs", "tooltip": "absolute, or relative "
                                                   "to ComfyUI's input folder"}),
                             "skip_invalid": ("BOOLEAN", {"default": False,
                                                          "tooltip": "off: any broken pair stops with the list of "
                                                                     "problems; on: train on the good pairs"})},
                "optional": {"keep_captionless": ("BOOLEAN", {
                    "default": False, "tooltip": "on: pairs without a caption do not stop this node, so that "
                    "Dataset Doctor (with a text encoder) can propose their captions; Build Cache and Train still "
                    "refuse them (skip_invalid on: leave them out)"})}}

    def load(self, folder, skip_invalid, keep_captionless=False):
        path = _folder(folder)
        report = load_dataset(path, skip_invalid=skip_invalid, keep_captionless=keep_captionless)
        captionless = tuple(e.name for e in report.examples if not e.caption)
        report = replace(report, examples=tuple(e for e in report.examples if e.caption))
        counts = sorted({len(e.controls) for e in report.examples})
        summary = (f"{len(report.examples)} pairs ({report.layout} layout), "
                   f"{'/'.join(map(str, counts))} control image(s) each; {len(report.skipped)} skipped"
                   + (f"; {len(captionless)} without a caption (first: {captionless[0]}), for Dataset Doctor: "
                      f"training {'leaves them out' if skip_invalid else 'refuses them'}" if captionless else ""))
        return {"ui": {"text": [summary]}, "result": (DatasetHandle(path, report, skip_invalid=skip_invalid,
                                                                    captionless=captionless), summary)}


class QwenEditSyntheticDataset:
    """Writes the demo's learnable edit (invert the colours) as pairs, so a workflow runs anywhere."""

    CATEGORY = f"{CATEGORY}/training"
    SEARCH_ALIASES = ["demo dataset", "synthetic pairs", "example dataset"]
    DESCRIPTION = ("Writes a small demo dataset (the edit: invert the colours) so training workflows run "
                   "anywhere.")
    RETURN_TYPES = (DATASET, "IMAGE")
    RETURN_NAMES = ("dataset", "example_control")
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"folder": ("STRING", {"default": "qwen_edit_demo_pairs",
                                                   "tooltip": "where the pairs are written: absolute, or relative "
                                                              "to ComfyUI's input folder"}),
                             "count": ("INT", {"default": 16, "min": 2, "max": 1000,
                                               "tooltip": "number of before/after pairs (8-16 for a demo)"}),
                             "seed": ("INT", {"default": 0, "min": 0, "max": 2**31 - 1,
                                              "control_after_generate": False,
                                              "tooltip": "the same seed writes the same pictures"})}}

    def make(self, folder, count, seed):
        from qwen_edit_core.demo import write_dataset
        path = _folder(folder)
        pairs = write_dataset(path, count, seed=seed)
        return (DatasetHandle(path, load_dataset(path)), files_to_image([pairs[0][0]]))


def _lora_path(name: str) -> Path:
    """A LoRA named in a text input: a file path, else a file of ComfyUI's loras folder."""
    return Path(name) if Path(name).is_file() else comfy_runtime.folder_file_path("loras", name)


def _config(handle, dataset: DatasetHandle, *, output_dir: Path, resolution: int, cache_dir: str = "",
            **sections):
    """A core Config from the loaded model (its directory and devices) and the node's widgets."""
    comps = handle.components
    resolution = side_of(resolution, handle)
    te = comps.text_encoder.device if comps.text_encoder is not None else "cpu"
    vae = next(comps.vae.parameters()).device if comps.vae is not None else "cpu"
    transformer = next(comps.transformer.parameters())
    dtype = str(transformer.dtype).removeprefix("torch.")
    files = {k: str(v) for k, v in (("transformer_file", comps.transformer_file), ("vae_file", comps.vae_file),
                                    ("text_encoder_file", comps.text_encoder_file),
                                    ("comfyui_dir", comps.comfyui_dir)) if v}
    base = {"model": {"pretrained_model_name_or_path": str(comps.model_dir), "dtype": dtype, **files},
            "data": {"folder": str(dataset.folder), "vae_area": resolution * resolution,
                     "skip_invalid": dataset.skip_invalid},
            "cache": {"dir": cache_dir or str(comfy_runtime.default_model_root() / "cache"),
                      "text_encoder_device": str(te), "vae_encoder_device": str(vae)},
            "train": {"output_dir": str(output_dir), "device": str(transformer.device)},
            # validation previews without a CFG of their own sample at the model's (1 on the toy models)
            "predict": {"true_cfg_scale": auto_cfg(handle)}}
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return load_config(overrides=base)


def _precision(choice: str, handle) -> str:
    """train.mixed_precision of the Train node's choice: "auto" is bf16 where the transformer is on a GPU, "no"
    on the CPU."""
    if choice != "auto":
        return choice
    return "no" if next(handle.components.transformer.parameters()).device.type == "cpu" else "bf16"


def training_examples(dataset: DatasetHandle) -> list:
    """The pairs training reads: the dataset's, unless Dataset From Folder kept caption-less pairs for the doctor
    with skip_invalid off; then the folder is read again as training reads it, which refuses them (DatasetError
    listing every problem, as Dataset From Folder does without keep_captionless)."""
    if dataset.captionless and not dataset.skip_invalid:
        return list(load_dataset(dataset.folder).examples)
    return list(dataset.report.examples)


class QwenEditBuildCache:
    """Precompute latents and embeddings of a dataset (reused across runs); progress bar; interruptible."""

    CATEGORY = f"{CATEGORY}/training"
    SEARCH_ALIASES = ["cache latents", "precompute embeddings", "latent cache"]
    DESCRIPTION = ("Encodes every pair of a dataset once (VAE latents and prompt embeddings) so training "
                   "needs only the transformer; reused across runs.")
    RETURN_TYPES = (DATASET, "STRING")
    RETURN_NAMES = ("dataset", "summary")
    FUNCTION = "build"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": (MODEL, {"tooltip": TIPS["model"]}),
                             "dataset": (DATASET, {"tooltip": TIPS["dataset"]}),
                             "resolution": RESOLUTION,
                             "cache_dir": ("STRING", {"default": "", "tooltip": "empty: models/qwen_edit/cache"})},
                "hidden": {"unique_id": "UNIQUE_ID"}}

    def build(self, model, dataset, resolution, cache_dir, unique_id=None):
        from qwen_edit_core.api import QwenImageEditTrainer
        config = _config(model, dataset, output_dir=comfy_runtime.output_dir() / "qwen_edit_runs" / "cache",
                         resolution=resolution, cache_dir=cache_dir)
        loaded_models.use(model)
        trainer = QwenImageEditTrainer(config)
        trainer.components = model.components  # reuse the loaded encoders
        examples = training_examples(dataset)
        bar = comfy_runtime.progress_bar(len(examples), node_id=unique_id)
        token = CancelToken()

        def progress(event):
            bar.update_absolute(event.step, event.total)
            if comfy_runtime.interrupt_requested():
                token.cancel()

        with torch.inference_mode(False):
            try:
                stats = trainer.cache(examples, progress=progress, cancel=token)
            except Cancelled:
                comfy_runtime.raise_if_interrupted()
                raise
        summary = f"{stats['total']} entries: {stats['hits']} reused, {stats['computed']} computed"
        handle = replace(dataset, cache_dir=Path(config.cache.dir), resolution=side_of(resolution, model))
        return {"ui": {"text": [summary]}, "result": (handle, summary)}


class QwenEditTrain:
    """Start LoRA training in the background and return a job handle at once. Deprecated: Train LoRA
    (QwenEditTrainLoRA) with Train Options replaces it; it stays loadable for saved workflows."""

    CATEGORY = f"{CATEGORY}/training"
    SEARCH_ALIASES = ["train lora (all inputs)"]
    DEPRECATED = True  # ComfyUI hides it from search and the node menu; saved workflows still load it
    DESCRIPTION = ("Starts LoRA training in the background and returns a job at once; watch it with Training "
                   "Status. The LoRA (or LoKr, LoHa, DoRA: lora_type, dora) lands in models/loras and loads with "
                   "stock LoraLoaderModelOnly.")
    RETURN_TYPES = (JOB,)
    RETURN_NAMES = ("job",)
    FUNCTION = "start"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": (MODEL, {"tooltip": TIPS["model"] + "; the LoRA trains on its transformer"}),
            "dataset": (DATASET, {"tooltip": TIPS["dataset"] + " (cached: Build Cache first)"}),
            "lora_name": ("STRING", {"default": "qwen_edit_lora", "tooltip": "file name of the LoRA in "
                                     "models/loras (.safetensors is added); also names the run folder"}),
            "steps": ("INT", {"default": 0, "min": 0, "max": 1_000_000,
                              "tooltip": "optimizer steps: 0 (auto): 250 for the built-in toy models, 1000 for a "
                                         "real model; 500-3000 steps for a style or edit on 20-100 pairs"}),
            # the frontend keeps as many decimals as `step` has: step 1e-7 keeps 1e-6, 1.5e-6 and 5e-7
            "learning_rate": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 1e-7, "round": 1e-7,
                                        "tooltip": "AdamW learning rate: 0 (auto): 1e-2 for the built-in toy models, "
                                                   "1e-4 for a real model; 1e-4 typical for rank 16 (5e-5 to 2e-4), "
                                                   "down to 1e-6 for gentle fine-tuning"}),
            "rank": ("INT", {"default": 16, "min": 1, "max": 512,
                             "tooltip": "LoRA rank: 16 typical (8-64); the file's size and what it can learn "
                                        "grow with it"}),
            "alpha": ("FLOAT", {"default": 16.0, "min": 0.01, "max": 1024.0, "step": 0.5, "round": 0.01,
                                "tooltip": "LoRA alpha: the update is scaled by alpha / rank; alpha = rank "
                                           "(scale 1) is typical, alpha = rank / 2 halves it"}),
            "targets": (list(TARGET_PRESETS), {"tooltip": "which linear layers get a LoRA: attn (image and "
                                               "text attention), attn-img (image attention only, smallest), all "
                                               "(attention and feed-forward, most capacity)"}),
            "batch_size": ("INT", {"default": 1, "min": 1, "max": 64,
                                   "tooltip": "pairs per step: 1 at 1024^2 on an 80 GB GPU (with "
                                              "checkpointing; BENCHMARKS.md), more at lower resolution"}),
            "resolution": RESOLUTION,
            "checkpoint_every": ("INT", {"default": 250, "min": 0, "max": 1_000_000,
                                         "tooltip": "save a resumable checkpoint every N steps (0: only at the "
                                                    "end and on stop); 250 typical"}),
            "resume": ("BOOLEAN", {"default": False, "tooltip": "continue from this lora_name's last checkpoint "
                                                                "(set steps to the new total)"}),
            # no "control after generate": a training seed must not change between queued runs (resume)
            "seed": ("INT", {"default": 0, "min": 0, "max": 2**31 - 1, "control_after_generate": False,
                             "tooltip": "seed of the LoRA's init, noise and timesteps (keep it for resume)"}),
            "use_cache": ("BOOLEAN", {"default": True, "tooltip": "off: encode every batch in real time"}),
        }, "optional": {
            "validation_image": ("IMAGE", {"tooltip": "a control image to edit every validation_every steps "
                                                      "(shows how the LoRA learns)"}),
            "validation_prompt": ("STRING", {"default": "", "multiline": True,
                                             "placeholder": "validation prompt: the edit to show on "
                                                            "validation_image, e.g. invert the colors",
                                             "tooltip": "the prompt for the validation image"}),
            "validation_every": ("INT", {"default": 0, "min": 0, "max": 1_000_000,
                                         "tooltip": "0: no validation images"}),
            "memory_budget_gb": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1024.0, "step": 1.0,
                                           "tooltip": "pick checkpointing, fp8 and CPU offload to fit this many "
                                                      "GiB of GPU memory (estimated; 16 for 1024^2 Edit); 0: fit "
                                                      "the GPU's free memory once ComfyUI unloaded its models. A 24 "
                                                      "GB card needs the scaled-fp8 transformer file (or the "
                                                      "loader's transformer_fp8 on); the host RAM "
                                                      "each card needs: docs/MEMORY.md, \"What a machine needs\""}),
            "fp8_base": ("BOOLEAN", {"default": False, "tooltip": "fp8 matmuls for the frozen base (Ada/Hopper); "
                                                                  "the LoRA trains in bf16/fp32"}),
            "compile": ("BOOLEAN", {"default": False, "tooltip": "compile each block (once, at the first step; "
                                                                 "CUDA; compile time: BENCHMARKS.md)"}),
            "attention": (list(speed.ATTENTION_KERNELS), {"tooltip": "cudnn: fastest on Hopper GPUs"}),
            "ema_decay": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 0.99999, "step": 0.0001,
                                    "tooltip": "> 0: also save an exponential moving average of the LoRA "
                                               "(LORA_NAME_ema.safetensors), e.g. 0.999; 0: off"}),
            "ema_validation": ("BOOLEAN", {"default": False, "tooltip": "with ema_decay: validation images use "
                                                                        "the averaged LoRA"}),
            "mask_weight": ("FLOAT", {"default": 2.0, "min": 0.0, "max": 100.0, "step": 0.1,
                                      "tooltip": "loss weight inside the edited region of pairs with a mask "
                                                 "(NAME_mask.png or masks/NAME.png, white = edited)"}),
            "unmasked_weight": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 100.0, "step": 0.1,
                                          "tooltip": "loss weight outside the masks' edited regions"}),
            "bucket_grouping": (["similar", "similar-count", "equal"], {
                "tooltip": "similar: neighbouring sizes (and any numbers of control images) share a batch; "
                           "similar-count: one number of control images per batch; equal: one exact size"}),
            "validation_previews": ("STRING", {
                "default": "", "multiline": True,
                "placeholder": "validation previews: one per line, e.g. lightning steps=4 cfg=1",
                "tooltip": "several previews side by side in the validation grid, one per line: SCHEDULE "
                           "[steps=N] [cfg=X] [shift=S] [lora=FILE[:STRENGTH]] [label=TEXT], SCHEDULE one of "
                           "diffusers, comfyui, lightning; e.g. 'diffusers steps=30' and 'lightning steps=4 "
                           "lora=Qwen-Image-Edit-Lightning-4steps.safetensors' (FILE: a name in the loras "
                           "folder). Empty: one preview"}),
            "companion_loras": ("STRING", {
                "default": "", "multiline": True, "placeholder": "companion LoRAs: FILE[:STRENGTH] per line",
                "tooltip": "LoRAs kept active and frozen while training, FILE[:STRENGTH] per line (names in the "
                           "loras folder), e.g. a Lightning LoRA to train on top of; the saved LoRA holds only "
                           "the trained one"}),
            "control_size": (["pipeline", "target"], {
                "tooltip": "target: every control resized to exactly its target's size (pixel-aligned pairs; "
                           "sample with control_size target); pipeline: each control at the training area"}),
            "job_name": ("STRING", {"default": "", "tooltip": "name to find this job by (Training Status, Stop "
                                                              "Training, the job list); empty: the LoRA name"}),
            "lora_type": (["lora", "lokr", "loha"], {
                "tooltip": "the adapter: lora (low-rank up @ down); lokr (Kronecker product of two factors, "
                           "w2 low-rank when rank < half its side: more capacity per byte); loha (Hadamard "
                           "product of two low-rank pairs). All load with stock LoraLoaderModelOnly"}),
            "dora": ("BOOLEAN", {"default": False, "tooltip": "DoRA (lora_type lora only): also learn a "
                                                              "magnitude per output row (saved as dora_scale)"}),
            "gradient_checkpointing": ("BOOLEAN", {
                "default": True, "tooltip": "recompute blocks in the backward pass instead of keeping their "
                                            "activations (the 20 B model needs it at 1024^2 on 80 GB); the memory "
                                            "budget decides how many blocks"}),
            "mixed_precision": (["auto", "bf16", "fp16", "no"], {
                "tooltip": "autocast of the forward pass: bf16 (half the activation memory of fp32; the LoRA "
                           "and its optimizer stay fp32), fp16 (with loss scaling), no: the model's dtype; auto: "
                           "bf16 on a GPU, the model's dtype on the CPU (where bf16 is slow)"}),
            "validation_pairs": ("INT", {"default": 0, "min": 0, "max": 64, "tooltip": (
                "keep the dataset's last N pairs (by name) out of training and sample them every validation_every "
                "steps: their error to their targets is logged (validation/metrics.csv, metrics.png) and shown "
                "in the live view; it rises again when the LoRA overfits. 0: off")}),
            "overwrite": OVERWRITE,
            "cpu_threads": ("INT", {"default": 0, "min": 0, "max": 1024, "tooltip": (
                "torch's CPU threads for the job (training on the CPU; on a GPU it makes no difference). 0: "
                "auto, one on 4 cores or fewer or a busy machine (tiny operations wait on each other's threads "
                "there), else the cores the load leaves free")}),
        }}

    def start(self, model, dataset, lora_name, steps, learning_rate, rank, alpha, targets, batch_size, resolution,
              checkpoint_every, resume, seed, use_cache, validation_image=None, validation_prompt="",
              validation_every=0, memory_budget_gb=0.0, fp8_base=False, compile=False, attention="auto",
              ema_decay=0.0, ema_validation=False, mask_weight=2.0, unmasked_weight=1.0,
              bucket_grouping="similar",
              validation_previews="", companion_loras="", control_size="pipeline", job_name="", lora_type="lora",
              dora=False, gradient_checkpointing=True, mixed_precision="auto", validation_pairs=0, overwrite=False,
              cpu_threads=0):
        name = lora_name.strip().removesuffix(".safetensors")
        check_file_name(name, "lora_name")
        auto_steps, auto_lr = training_defaults(model)
        steps, learning_rate = steps or auto_steps, learning_rate or auto_lr  # 0: auto from the model
        out = comfy_runtime.output_dir() / "qwen_edit_runs" / name
        cache_dir = str(dataset.cache_dir) if dataset.cache_dir else ""
        validation = {}
        if validation_image is not None and validation_every > 0:
            # The core validates from a file (it is cached like a training sample).
            out.mkdir(parents=True, exist_ok=True)
            path = out / "validation_input.png"
            image_to_pils(validation_image)[0].save(path)
            validation = {"validation_every": validation_every, "validation_image": str(path),
                          "validation_prompt": validation_prompt,
                          "validation_previews": parse_previews(validation_previews, _lora_path)}
        if validation_pairs > 0:
            validation.update(validation_every=validation_every, validation_pairs=validation_pairs)
        stack = parse_lora_lines(companion_loras, _lora_path)
        config = _config(model, dataset, output_dir=out, resolution=resolution, cache_dir=cache_dir,
                         model={"lora": {"rank": rank, "alpha": alpha, "targets": targets, "stack": stack,
                                         "type": lora_type, "dora": dora}},
                         data={"batch_size": batch_size, "bucket_grouping": bucket_grouping,
                               "control_size": control_size},
                         cache={"enabled": use_cache},
                         train={"max_steps": steps, "seed": seed, "checkpoint_every": checkpoint_every,
                                "lora_name": name, "memory_budget_gb": memory_budget_gb,
                                "memory_budget_auto": True, "gradient_checkpointing": gradient_checkpointing,
                                "mixed_precision": _precision(mixed_precision, model), "fp8_base": fp8_base,
                                "compile": compile, "attention": attention, "ema_decay": ema_decay,
                                "ema_validation": ema_validation, "mask_weight": mask_weight,
                                "unmasked_weight": unmasked_weight, "cpu_threads": cpu_threads, **validation},
                         optimizer={"lr": learning_rate})
        resume_arg = True if resume and (out / "checkpoints").is_dir() else None
        # ComfyUI's own models leave the training device first; the job trains on the graph's transformer
        # (one copy of the weights), which the sampler nodes leave alone while the job runs.
        loaded_models.use(model)
        comfy_runtime.free_device_memory(config.train.device, keep=loaded_models.modules_of(model),
                                         busy=loaded_models.busy, owned=loaded_models.owned)
        # Re-queuing the graph that started a job returns that job (attach) instead of failing.
        try:
            job = jobs.REGISTRY.start(config, name=job_name.strip() or name, resume=resume_arg,
                                      model=model.components, overwrite=overwrite)
        except OutputDirTakenError:
            raise OutputDirTakenError(taken_words(name, out)) from None
        # ComfyUI keeps counting what the job holds and cannot unload it (comfy_runtime.count_job)
        comfy_runtime.count_job(job, loaded_models.modules_of(model), torch.device(jobs.device_key(job.device)))
        return (job,)


def taken_words(name: str, out: Path) -> str:
    """The refusal of a new run under a LoRA name whose run folder holds another run, in the Train node's words
    (the core's speaks of the command line's --resume, --output-dir and --overwrite)."""
    what = previous_run(out) or "checkpoints of another run"
    return (f"lora_name {name!r} was trained before: {out} holds {what}. Turn resume on to continue that run, "
            "give another lora_name, or turn overwrite on to move the old run aside (into a sibling folder "
            f"{out.name}.replaced-<time>) and train anew")


def find_job(job, job_name: str) -> jobs.TrainingJob:
    """The job from the JOB link, else the one called `job_name` (running or finished in this server)."""
    if job is not None:
        return job
    if not job_name.strip():
        raise ValueError("connect the Train node's job output or type the job's name (its lora_name) in job_name")
    return jobs.REGISTRY.get(job_name)


class QwenEditTrainStatus:
    """Wait for (or look at) a training job found by its JOB link or its name: progress bar with the live
    loss; an interrupt stops the job with a checkpoint. With `wait` it holds ComfyUI's queue only while
    nothing else is queued: queue another prompt and it returns the running job's status at once (the job
    carries on and puts its LoRA into models/loras when done). Returns the LoRA's name in the loras folder
    (empty until the job finished), its path, the loss plot and validation images."""

    DESCRIPTION = __doc__
    CATEGORY = f"{CATEGORY}/training"
    SEARCH_ALIASES = ["training progress", "wait for training", "job status", "loss"]
    DESCRIPTION = ("Shows a training job's progress and loss, found by its job link or its name, or waits for "
                   "it while nothing else is queued; interrupting stops the job with a checkpoint. Outputs the "
                   "LoRA's name and path (once finished), the loss plot and validation images.")
    RETURN_TYPES = ("STRING", "STRING", "IMAGE", "IMAGE", "FLOAT")
    RETURN_NAMES = ("lora_name", "lora_path", "loss_plot", "validation", "loss")
    OUTPUT_TOOLTIPS = ("the LoRA's file name in models/loras (empty until the job finished)",
                       "the LoRA's full path (empty until the job finished)",
                       "the loss plot (none yet: the nodes it feeds are skipped)",
                       "the latest validation images (none yet: the nodes it feeds are skipped)",
                       "the latest logged loss; NaN before the first logged step (and when the loss is NaN)")
    FUNCTION = "status"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"wait": ("BOOLEAN", {"default": True, "tooltip": "wait for the job to finish "
                                                  "(until another prompt is queued); off: report at once"})},
                "optional": {"job": (JOB, {"tooltip": "the Train node's job; or leave it unconnected and "
                                                      "give job_name"}),
                             "job_name": ("STRING", {"default": "", "tooltip": "find a running or finished "
                                                     "job by name (the Train node's lora_name or job_name)"})},
                "hidden": {"unique_id": "UNIQUE_ID"}}

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")  # the job moves on between runs

    def status(self, wait, job=None, job_name="", unique_id=None):
        job = find_job(job, job_name)
        bar = comfy_runtime.progress_bar(job.config.train.max_steps, node_id=unique_id)

        def tick(status):
            # ComfyUI's progress bar raises on an interrupt: stop the job (it saves a checkpoint) first.
            if comfy_runtime.interrupt_requested():
                job.stop()
                log.warning("interrupted: training job %r stopped; %s (queue Train again with resume on to "
                            "continue)", job.name, outcome(job.wait()))
                comfy_runtime.raise_if_interrupted()
            try:
                bar.update_absolute(status.step, status.total)
            except BaseException:
                job.stop()
                job.wait()
                raise

        status = (jobs.wait_for(job, on_tick=tick, until=comfy_runtime.other_prompts_queued) if wait
                  else job.status())
        if status.state == "failed" and wait:  # the graph waited for a LoRA that will not come
            raise RuntimeError(f"training job {status.name!r} failed: {status.error}")
        name, path = (status.delivered.name, str(status.delivered)) if status.delivered else ("", "")
        text = f"{status.name}: {status.state}, step {status.step}/{status.total}, {loss_words(status.loss)}"
        text += heldout_text(status.validation_metrics)
        said = outcome(status)
        text += f" ({said})" if said else " (still running; its LoRA goes to models/loras when done)"
        return {"ui": {"text": [text]},
                "result": (name, path, _pictures([status.loss_plot] if status.loss_plot else []),
                           _pictures(status.validation_images), loss_value(status.loss))}


def loss_words(loss: float | None) -> str:
    """The status text's loss: its value, a non-finite one said as such, or none logged yet."""
    if loss is None:
        return "no loss yet"
    return f"loss {loss:.4f}" if math.isfinite(loss) else f"loss {loss} (not finite)"


def loss_value(loss: float | None) -> float:
    """The FLOAT loss output: NaN before the first logged step, since any number (0.0 above all) would read as
    a measured loss to a node that compares or plots it, and NaN compares false with every threshold."""
    return float("nan") if loss is None else float(loss)


def _pictures(paths):
    """PNG files as an IMAGE, or (none yet) nothing: the Preview Image fed by it is skipped, not shown black."""
    return files_to_image(paths) if paths else comfy_runtime.nothing()
