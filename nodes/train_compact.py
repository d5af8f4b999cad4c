"""The compact training nodes: Train LoRA with the inputs most runs change, and Train Options with the
advanced ones (alpha, adapter kind, speed and memory levers, EMA, masks, preview grid, companion LoRAs), like
ComfyUI's own sampler and guider option nodes. A training workflow then opens readable on a 1920x1080 screen
(the full node's 31 widgets forced the frontend below its 0.6 zoom where no text is drawn).

The full node (QwenEditTrain) stays loadable, marked deprecated: saved workflows keep widget values by
position, so it never changes its inputs; both nodes start the same job."""

from __future__ import annotations

from dataclasses import dataclass, fields

from .common import CATEGORY, JOB
from .train_nodes import QwenEditTrain

TRAIN_OPTIONS = "QWEN_EDIT_TRAIN_OPTIONS"


@dataclass(frozen=True)
class TrainOptions:
    """The advanced training inputs, with the full Train node's defaults (so an unconnected options input
    trains exactly like that node left at its defaults)."""

    alpha: float = 16.0
    seed: int = 0
    lora_type: str = "lora"
    dora: bool = False
    memory_budget_gb: float = 0.0
    gradient_checkpointing: bool = True
    mixed_precision: str = "auto"
    fp8_base: bool = False
    compile: bool = False
    attention: str = "auto"
    ema_decay: float = 0.0
    ema_validation: bool = False
    mask_weight: float = 2.0
    unmasked_weight: float = 1.0
    bucket_grouping: str = "similar"
    control_size: str = "pipeline"
    validation_previews: str = ""
    companion_loras: str = ""
    job_name: str = ""
    validation_pairs: int = 0
    cpu_threads: int = 0


def _full_inputs() -> dict:
    """The full Train node's inputs by name (their tooltips and ranges are the compact nodes' too)."""
    spec = QwenEditTrain.INPUT_TYPES()
    return {**spec["required"], **spec["optional"]}


def _default(spec: tuple):
    """An input's default as the frontend fills it: a combo's first choice, else its "default"."""
    return spec[0][0] if isinstance(spec[0], list) else spec[1]["default"]


class QwenEditTrainOptions:
    """Advanced training settings for Train LoRA's options input."""

    CATEGORY = f"{CATEGORY}/training"
    DESCRIPTION = ("Advanced settings for Train LoRA: the adapter (alpha, lora_type, dora), seed, "
                   "memory and speed levers, EMA, mask weights, the validation preview grid, companion "
                   "LoRAs and held-out validation pairs. Unconnected, Train LoRA uses these defaults.")
    SEARCH_ALIASES = ["lora options", "training options", "advanced training", "ema", "lokr", "loha", "dora"]
    RETURN_TYPES = (TRAIN_OPTIONS,)
    RETURN_NAMES = ("options",)
    FUNCTION = "options"

    @classmethod
    def INPUT_TYPES(cls):
        full = _full_inputs()
        return {"required": {f.name: full[f.name] for f in fields(TrainOptions)}}

    def options(self, alpha, seed, lora_type, dora, memory_budget_gb, gradient_checkpointing,
                mixed_precision, fp8_base, compile, attention, ema_decay, ema_validation, mask_weight,
                unmasked_weight, bucket_grouping, control_size, validation_previews, companion_loras, job_name,
                validation_pairs=0, cpu_threads=0):
        return (TrainOptions(alpha, seed, lora_type, dora, memory_budget_gb, gradient_checkpointing,
                             mixed_precision, fp8_base, compile, attention, ema_decay, ema_validation, mask_weight,
                             unmasked_weight, bucket_grouping, control_size, validation_previews, companion_loras,
                             job_name, validation_pairs, cpu_threads),)


#: the compact node's widgets, taken from the full node in this order
ESSENTIAL = ("lora_name", "steps", "learning_rate", "rank", "targets", "batch_size", "resolution",
             "checkpoint_every", "use_cache", "resume")


class QwenEditTrainLoRA:
    """Start LoRA training in the background (the essential inputs; the rest on Train Options)."""

    CATEGORY = f"{CATEGORY}/training"
    DESCRIPTION = ("Starts LoRA training in the background and returns a job at once; watch it with Training "
                   "Status. The LoRA lands in models/loras and loads with stock LoraLoaderModelOnly. Connect "
                   "Train Options for the adapter kind, speed levers, EMA, masks and preview grid.")
    SEARCH_ALIASES = ["train lora", "lora training", "fine-tune", "finetune", "qwen edit train"]
    RETURN_TYPES = (JOB,)
    RETURN_NAMES = ("job",)
    FUNCTION = "start"

    @classmethod
    def INPUT_TYPES(cls):
        full = _full_inputs()
        return {"required": {"model": full["model"], "dataset": full["dataset"],
                             **{name: full[name] for name in ESSENTIAL}},
                "optional": {"validation_image": full["validation_image"],
                             "validation_every": full["validation_every"],
                             "validation_prompt": full["validation_prompt"],
                             "options": (TRAIN_OPTIONS, {"tooltip": "Train Options: the advanced settings; "
                                                                    "unconnected, their defaults"}),
                             "overwrite": full["overwrite"]}}

    def start(self, model, dataset, lora_name, steps, learning_rate, rank, targets, batch_size, resolution,
              checkpoint_every, use_cache, resume, validation_image=None, validation_every=0,
              validation_prompt="", options=None, overwrite=False):
        opts = options or TrainOptions()
        advanced = {f.name: getattr(opts, f.name) for f in fields(TrainOptions)}
        return QwenEditTrain().start(model, dataset, lora_name=lora_name, steps=steps, learning_rate=learning_rate,
                                     rank=rank, targets=targets, batch_size=batch_size, resolution=resolution,
                                     checkpoint_every=checkpoint_every, use_cache=use_cache, resume=resume,
                                     validation_image=validation_image, validation_every=validation_every,
                                     validation_prompt=validation_prompt, overwrite=overwrite, **advanced)
