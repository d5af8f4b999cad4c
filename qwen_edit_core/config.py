"""One frozen config, read from YAML with the seeds' sections.

Sections: model, data, cache, train, optimizer, lr_scheduler, logging, predict. Every key is a typed field;
an unknown key or a value of the wrong type is an error that names its dotted path (``train.lerning_rate``),
so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from qwen_edit_core.common.names import file_name_problem, label_problem
from qwen_edit_core.common.typed import ConfigError, expand_env, from_dict, show  # noqa: F401 (re-exported)
from qwen_edit_core.common.yaml_read import YamlTooLargeError, read_yaml
from qwen_edit_core.model.geometry import MAX_PIXELS, MAX_STEPS
from qwen_edit_core.families import variants
from qwen_edit_core.families.templates import EMPTY_PROMPT

log = logging.getLogger(__name__)

#: mirrors speed.ATTENTION_KERNELS (kept here so reading a config never imports torch)
AttentionKernel = typing.Literal["auto", "cudnn", "flash", "efficient", "math", "flash3"]
Quantize = typing.Literal["none", "int8", "nf4"]
ControlSize = typing.Literal["pipeline", "target"]
BucketGrouping = typing.Literal["equal", "similar", "similar-count"]
MixedPrecision = typing.Literal["no", "fp32", "bf16", "fp16"]
#: mirror sample.flow.TIMESTEP_SCHEMES / LOSS_WEIGHTINGS and train.optim.SCHEDULES
TimestepSampling = typing.Literal["shift", "uniform", "logit_normal", "fixed_shift"]
LossWeighting = typing.Literal["none", "sigma_sqrt", "cosmap"]
OptimizerType = typing.Literal["adamw", "adamw8bit"]
ScheduleType = typing.Literal["constant", "constant_with_warmup", "linear", "cosine"]
CfgMode = typing.Literal["sequential", "batched", "split"]
LoraFormat = typing.Literal["split", "fused"]
ShiftMode = typing.Literal["dynamic", "fixed"]
LoraInit = typing.Literal["default", "gaussian"]
#: mirrors adapters.kinds.ADAPTER_TYPES
LoraType = typing.Literal["lora", "lokr", "loha"]
ContextParallelMode = typing.Literal["ulysses", "ring"]
#: mirrors sample.schedules.SCHEDULES
Schedule = typing.Literal["diffusers", "comfyui", "lightning"]
#: a families/variants.py name, or "" (detected from the model)
VariantName = typing.Literal[("", *variants.NAMES)]


@dataclass(frozen=True)
class LoraStackItem:
    """A LoRA file kept active at a strength (frozen while training; stacked in a validation preview)."""
    path: str = ""
    strength: float = 1.0


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 16
    alpha: float = 16.0
    #: a preset name ("attn", "attn-img", "all"), a comma-separated string or a list of module-name suffixes
    targets: str | tuple[str, ...] = "attn"
    dropout: float = 0.0
    init: LoraInit = "default"
    #: LoRA file(s) to start from (continue training); any layout lora.read_lora_file accepts
    init_from: str | None = None
    #: companion LoRA files kept active and frozen while training ([{path, strength}], e.g. a Lightning or style
    #: LoRA to train on top of); the saved file holds only the trained LoRA; resume restores the stack
    stack: tuple[LoraStackItem, ...] = ()
    #: the adapter: "lora", "lokr" (Kronecker factors) or "loha" (Hadamard product), saved in ComfyUI's keys
    type: LoraType = "lora"
    #: DoRA (type lora only): a learned magnitude per output row, saved as ComfyUI's dora_scale
    dora: bool = False


@dataclass(frozen=True)
class ModelConfig:
    #: a local diffusers-layout directory (or a hub id already in the local HF cache)
    pretrained_model_name_or_path: str = ""
    #: a variant name (`families.variants.NAMES`, listed in docs/MODEL.md); empty = detected from the model
    variant: VariantName = ""
    #: weight dtype of the frozen base and the encoders
    dtype: str = "float32"
    #: "none", "int8" or "nf4" (bitsandbytes) for the frozen transformer
    quantize: Quantize = "none"
    lora: LoraConfig = field(default_factory=LoraConfig)
    #: a transformer as one safetensors file (ComfyUI's diffusion_models layout, bf16/fp32 or scaled fp8);
    #: the other components still come from pretrained_model_name_or_path
    transformer_file: str = ""
    #: the VAE as one safetensors file (ComfyUI's qwen_image_vae.safetensors layout, or diffusers')
    vae_file: str = ""
    #: the text encoder as one safetensors file (ComfyUI's text_encoders/qwen_2.5_vl_7b*.safetensors, bf16/fp32
    #: or scaled fp8); its tokenizer comes from the model directory's processor/, else from comfyui_dir
    text_encoder_file: str = ""
    #: a ComfyUI models folder: transformer_file / vae_file / text_encoder_file may then be bare file names of its
    #: diffusion_models/, vae/ and text_encoders/ folders
    comfyui_models_dir: str = ""
    #: a ComfyUI installation whose bundled Qwen2.5 tokenizer (comfy/text_encoders/qwen25_tokenizer/) serves a
    #: text encoder file when the model directory has no processor/; empty: the parent of comfyui_models_dir
    #: when it is a ComfyUI installation (inside ComfyUI the nodes pass the running one)
    comfyui_dir: str = ""
    #: a scaled-fp8 transformer_file: "keep" its block linears in fp8 (fp8 matmuls, half the memory of bf16),
    #: "upcast" them to dtype, or "auto" (keep on CUDA GPUs that compute in fp8, upcast elsewhere)
    transformer_fp8: typing.Literal["auto", "keep", "upcast"] = "auto"


@dataclass(frozen=True)
class DataConfig:
    folder: str = ""
    skip_invalid: bool = False
    convert_modes: bool = False
    #: pixel area of the target and of each control image as the VAE sees them (sides rounded to 32)
    vae_area: int = 1024 * 1024
    #: pixel area of the control images as the vision-language encoder sees them (variants whose `vl_own_area` is
    #: set, Edit Plus; the others feed the VL the VAE-sized image, as their pipelines do)
    vl_area: int = 384 * 384
    batch_size: int = 1
    #: "equal": a batch holds one bucket (no padding); "similar": neighbouring sizes share a batch (padded,
    #: masked, equal to one-by-one), whatever their numbers of control images; "similar-count": like
    #: similar, but a batch holds pairs with one number of control images
    bucket_grouping: BucketGrouping = "equal"
    caption_dropout_rate: float = 0.0
    prompt_image_dropout_rate: float = 0.0
    #: "pipeline": each control image at the VAE area (as the pipelines); "target": every control resized to
    #: exactly the target's size (pixel-aligned pairs; sample with predict.control_size: target)
    control_size: ControlSize = "pipeline"
    #: the edit keeps every pixel in place (a recolouring, a restyle): the dataset doctor's fixes realign targets
    #: shifted or zoomed against their control only then (`pixel_aligned_edit`; control_size "target" implies it)
    pixel_aligned: bool = False
    #: the dataset doctor before the first step (data/doctor/): "warn" logs its summary, "refuse" stops the run
    #: when it flags a pair, "off" skips it
    doctor: typing.Literal["warn", "refuse", "off"] = "warn"

    @property
    def pixel_aligned_edit(self) -> bool:
        """Whether the pairs are meant pixel-aligned: `pixel_aligned`, or every control resized to its target's size."""
        return self.pixel_aligned or self.control_size == "target"


@dataclass(frozen=True)
class CacheConfig:
    #: where entries live; shared across runs and datasets (content-addressed)
    dir: str = ""
    #: train from the cache (True) or encode each batch in real time (False)
    enabled: bool = True
    text_encoder_device: str = "cpu"
    vae_encoder_device: str = "cpu"


@dataclass(frozen=True)
class ValidationPreview:
    """One validation preview: a named schedule, its steps/CFG/shift and LoRA files stacked for it only."""
    #: "diffusers", "comfyui" or "lightning" (qwen_edit_core/sample/schedules.py)
    schedule: Schedule = "diffusers"
    steps: int | None = None  # null: the schedule's (lightning 4), else train.validation_steps
    cfg: float | None = None  # null: the schedule's (lightning 1.0) or sigma preset's, else predict.true_cfg_scale
    shift: float | None = None  # null: the schedule's shift
    #: an explicit sigma list or a preset name (sample/schedules.py SIGMA_PRESETS); its length is the steps
    sigmas: tuple[float, ...] | str = ()
    #: LoRA files active in this preview only ([{path, strength}]), beside the trained LoRA and model.lora.stack
    loras: tuple[LoraStackItem, ...] = ()
    #: the grid label; empty: "<schedule> <steps> steps, CFG <cfg>"
    label: str = ""


@dataclass(frozen=True)
class TrainConfig:
    output_dir: str = "output"
    device: str = "cpu"
    seed: int = 0
    max_steps: int = 100
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0
    mixed_precision: MixedPrecision = "no"
    gradient_checkpointing: bool = False
    #: "shift" (the sampler's resolution-dependent schedule), "uniform", "logit_normal", "fixed_shift"
    timestep_sampling: TimestepSampling = "shift"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    fixed_shift: float = 3.0
    #: "none", "sigma_sqrt", "cosmap"
    loss_weighting: LossWeighting = "none"
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    validation_every: int = 0
    validation_prompt: str = ""
    validation_image: str = ""
    validation_steps: int = 8
    #: several previews side by side in one labelled grid per validation step ([{schedule, steps, cfg, shift,
    #: loras, label}]); empty: one preview with predict.schedule
    validation_previews: tuple[ValidationPreview, ...] = ()
    #: pairs kept out of training, sampled at each validation step (error to target: validation/metrics.csv):
    #: N = the dataset's last N pairs by name, or a folder of pairs; 0 / "": none
    validation_pairs: int | str = 0
    lora_name: str = "lora"
    #: the saved file's MLP layout where the model fuses its MLP input halves in ComfyUI: "split" (diffusers,
    #: DiffSynth, peft; ComfyUI reads it too) or "fused" (ComfyUI's and ai-toolkit's own); adapters/lora_files.py
    lora_format: LoraFormat = "split"
    #: speed levers (qwen_edit_core/speed/). compile: compile each transformer block (CUDA; ~30 s once)
    compile: bool = False
    #: with gradient_checkpointing: how many blocks recompute (-1: all); the rest keep their activations
    checkpoint_blocks: int = -1
    #: keep the frozen base's block linears in e4m3 with per-channel scales (fp8 matmuls on Ada/Hopper)
    fp8_base: bool = False
    #: blocks whose frozen weights live in pinned CPU memory and are streamed in (needs checkpointing)
    offload_blocks: int = 0
    #: > 0: choose gradient_checkpointing, checkpoint_blocks, fp8_base and offload_blocks to fit this many GiB
    memory_budget_gb: float = 0.0
    #: with memory_budget_gb 0 on a CUDA device: size the planner to the device's free memory when training
    #: starts (plus the transformer's own weights already there; the ComfyUI Train node turns this on)
    memory_budget_auto: bool = False
    #: which attention kernel goes first (speed/attention.py: "auto" is torch's order; cudnn, flash, efficient,
    #: math; flash3 where FlashAttention-3 is installed)
    attention: AttentionKernel = "auto"
    #: with an fp8 base: the base's input gradients as fp8 matmuls too (e4m3, per-row scales; faster,
    #: slightly noisier gradients)
    fp8_backward: bool = False
    #: optimizer steps with a non-finite (NaN/Inf) loss that are skipped (gradients dropped) before training
    #: stops; 0: stop at the first one. Training that stops keeps its last good checkpoint
    skip_nonfinite_steps: int = 0
    #: region-weighted loss for pairs with a mask (NAME_mask.png or masks/NAME.png; white = edited region):
    #: each target token's squared error is weighted mask_weight inside the region, unmasked_weight outside
    mask_weight: float = 2.0
    unmasked_weight: float = 1.0
    #: > 0: keep an exponential moving average of the LoRA (e.g. 0.999), saved as LORA_NAME_ema.safetensors
    ema_decay: float = 0.0
    #: with ema_decay: validation images use the averaged LoRA instead of the trained one
    ema_validation: bool = False
    #: torch's intra-op CPU threads while a background job (ComfyUI's Train LoRA) trains; 0: chosen from the
    #: cores and load (common/threads.py: 1 on a machine of 4 cores or fewer or a busy one). It matters for
    #: CPU training only: on a GPU the CPU just launches kernels
    cpu_threads: int = 0


@dataclass(frozen=True)
class OptimizerConfig:
    #: "adamw" or "adamw8bit" (bitsandbytes, CUDA)
    type: OptimizerType = "adamw"
    lr: float = 1e-4
    betas: tuple[float, ...] = (0.9, 0.999)
    weight_decay: float = 0.01
    eps: float = 1e-8


@dataclass(frozen=True)
class LRSchedulerConfig:
    #: "constant", "constant_with_warmup", "linear", "cosine"
    type: ScheduleType = "constant_with_warmup"
    warmup_steps: int = 0


@dataclass(frozen=True)
class LoggingConfig:
    csv: bool = True
    tensorboard: bool = False
    plot: bool = True
    #: read the loss from the device (one sync) and log the mean of the last `every` steps' losses
    every: int = 1


@dataclass(frozen=True)
class PredictDevices:
    text_encoder: str = "cpu"
    vae: str = "cpu"
    transformer: str = "cpu"


@dataclass(frozen=True)
class PredictConfig:
    devices: PredictDevices = field(default_factory=PredictDevices)
    #: second transformer device for cfg_mode "split"
    uncond_device: str = ""
    dtype: str = "float32"
    #: steps and CFG scale when a call gives none and the schedule has none of its own (lightning: 4 and 1.0)
    num_inference_steps: int = 20
    true_cfg_scale: float = 4.0
    negative_prompt: str = EMPTY_PROMPT
    #: named schedule (qwen_edit_core/sample/schedules.py): "diffusers" (diffusers' pipelines), "comfyui" (stock
    #: ComfyUI's model sampling, simple scheduler, Euler, plain CFG and noise), "lightning" (fixed shift 3, no
    #: terminal stretch; 4 or 8 steps at CFG 1 with a Lightning LoRA)
    schedule: Schedule = "diffusers"
    #: a fixed shift replacing the schedule's own (comfyui: ModelSamplingAuraFlow's shift); null: the schedule's
    shift: float | None = None
    sigmas: tuple[float, ...] | str = ()  # explicit sigmas (descending, no final 0) or a schedules.SIGMA_PRESETS name
    kv_cache: bool = True  # Qwen-Image-2.1's prefix K/V cache (faster, same image)
    #: "sequential" (as diffusers), "batched" (cond+uncond in one call), "split" (two devices at once)
    cfg_mode: CfgMode = "sequential"
    #: "dynamic" (mu from the target token count, as diffusers) or "fixed" (ComfyUI's mu)
    shift_mode: ShiftMode = "dynamic"
    fixed_mu: float = 1.15
    vae_area: int = 1024 * 1024
    vl_area: int = 384 * 384
    #: compile each transformer block (CUDA; ~30 s once) and keep the base's block linears in fp8
    compile: bool = False
    fp8: bool = False
    #: which attention kernel goes first (speed/attention.py, as train.attention)
    attention: AttentionKernel = "auto"
    #: "target": controls resized to the output size (the control's own when a multiple of 16): for LoRAs
    #: trained with data.control_size: target; "pipeline": as diffusers
    control_size: ControlSize = "pipeline"
    #: split the transformer's tokens over this many processes (`torchrun`); 1: off
    context_parallel: int = 1
    #: "ulysses" (all-to-all over heads) or "ring" (keys/values around the ring)
    cp_mode: ContextParallelMode = "ulysses"


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    predict: PredictConfig = field(default_factory=PredictConfig)


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> Config:
    """Read a YAML config (seeds' sections); `overrides` is a nested dict applied on top of the file.
    Values are type-checked and range-checked (`check_ranges`) before anything else runs."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            data = read_yaml(path.read_text(encoding="utf-8")) or {}
        except YamlTooLargeError as err:
            raise ConfigError(f"config file {str(path)!r} is refused: {err}") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
        data = expand_env(data, source=f"config file {str(path)!r}: ")
    if overrides:
        data = _merge(data, overrides)
    problems: list[str] = []
    config = from_dict(Config, data, problems=problems)
    check_ranges(config, problems)
    return config


#: a pixel area: at least 64x64, at most the image limit (model/geometry.py), checked before any weight loads
AREA_RULE = f"in [4096, {MAX_PIXELS}] (64x64 pixels to the image limit)"
#: (dotted path, test, what it must be): every numeric field with a range, checked by `check_ranges`
_RANGES = [
    ("model.lora.rank", lambda v: v >= 1, ">= 1"), ("model.lora.alpha", lambda v: v > 0, "> 0"),
    ("model.lora.dropout", lambda v: 0 <= v < 1, "in [0, 1)"), ("optimizer.eps", lambda v: v > 0, "> 0"),
    ("data.vae_area", lambda v: 64 * 64 <= v <= MAX_PIXELS, AREA_RULE),
    ("data.vl_area", lambda v: 64 * 64 <= v <= MAX_PIXELS, AREA_RULE),
    ("data.caption_dropout_rate", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("data.prompt_image_dropout_rate", lambda v: 0 <= v <= 1, "in [0, 1]"),
    # an empty folder would resolve to the current directory: the run's files would land wherever it started
    ("train.output_dir", lambda v: v.strip() != "", "a folder (empty would write into the current directory)"),
    ("train.max_steps", lambda v: v >= 1, ">= 1"), ("data.batch_size", lambda v: v >= 1, ">= 1"),
    ("train.gradient_accumulation_steps", lambda v: v >= 1, ">= 1"),
    ("train.max_grad_norm", lambda v: v >= 0, ">= 0 (0: no clipping)"),
    ("train.logit_std", lambda v: v > 0, "> 0"), ("train.fixed_shift", lambda v: v > 0, "> 0"),
    ("train.checkpoint_every", lambda v: v >= 0, ">= 0 (0: only at the end)"),
    ("train.keep_checkpoints", lambda v: v >= 0, ">= 0 (0: keep all)"),
    ("train.validation_every", lambda v: v >= 0, ">= 0"),
    ("train.validation_steps", lambda v: 1 <= v <= MAX_STEPS, f"in [1, {MAX_STEPS}]"),
    ("train.checkpoint_blocks", lambda v: v >= -1, ">= -1 (-1: all)"),
    ("train.offload_blocks", lambda v: v >= 0, ">= 0"),
    ("train.memory_budget_gb", lambda v: v >= 0, ">= 0"),
    ("train.skip_nonfinite_steps", lambda v: v >= 0, ">= 0"),
    ("train.ema_decay", lambda v: 0 <= v < 1, "in [0, 1) (0: off)"),
    ("train.mask_weight", lambda v: v >= 0, ">= 0"),
    ("train.unmasked_weight", lambda v: v >= 0, ">= 0"),
    ("optimizer.lr", lambda v: v > 0, "> 0"),
    ("optimizer.weight_decay", lambda v: v >= 0, ">= 0"),
    ("optimizer.betas", lambda v: len(v) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in v),
     "two numbers in [0, 1)"),
    ("lr_scheduler.warmup_steps", lambda v: v >= 0, ">= 0"), ("logging.every", lambda v: v >= 1, ">= 1"),
    ("predict.num_inference_steps", lambda v: 1 <= v <= MAX_STEPS, f"in [1, {MAX_STEPS}]"),
    ("predict.true_cfg_scale", lambda v: v >= 0, ">= 0"),
    ("predict.vae_area", lambda v: 64 * 64 <= v <= MAX_PIXELS, AREA_RULE),
    ("predict.vl_area", lambda v: 64 * 64 <= v <= MAX_PIXELS, AREA_RULE),
    ("predict.context_parallel", lambda v: v >= 1, ">= 1 (1: off)"),
]


def name_problems(config: Config) -> list[str]:
    """Names that become file names or picture labels, each checked by its rule (common/names.py)."""
    bad = []
    problem = file_name_problem(config.train.lora_name)
    if problem:
        bad.append(f"train.lora_name: {show(config.train.lora_name)} {problem}")
    for i, preview in enumerate(config.train.validation_previews):
        problem = label_problem(preview.label)
        if problem:
            bad.append(f"train.validation_previews[{i}].label: {show(preview.label)} {problem}")
    return bad


def check_ranges(config: Config, problems: Sequence[str] = ()) -> None:
    """ConfigError naming every value out of its range by dotted path (`train.max_steps: -5 must be >= 1`) and
    every name unfit for a file (`name_problems`), after the `problems` already found (bad types and keys: all
    are reported together); a warning when the steps' warmup is longer than the run."""
    bad = list(problems)
    for path, test, rule in _RANGES:
        value = config
        for part in path.split("."):
            value = getattr(value, part)
        if not test(value) and not any(p.startswith((f"{path}:", f"{path}[")) for p in problems):
            bad.append(f"{path}: {show(value)} must be {rule}")  # (a value already named by its type: once)
    bad += name_problems(config)
    lora = config.model.lora
    if lora.dora and lora.type != "lora":
        bad.append(f"model.lora.dora: true works with model.lora.type lora only, not {lora.type!r}")
    if lora.type != "lora" and (lora.dropout or lora.init != "default"):
        bad.append(f"model.lora.dropout / model.lora.init apply to model.lora.type lora, not {lora.type!r}: leave "
                   "them at 0 / default")
    if bad:
        raise ConfigError("; ".join(bad))
    if config.lr_scheduler.warmup_steps > config.train.max_steps:
        log.warning("lr_scheduler.warmup_steps %d is more than train.max_steps %d: the learning rate never "
                    "reaches optimizer.lr", config.lr_scheduler.warmup_steps, config.train.max_steps)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def to_dict(config: Any) -> dict:
    """Plain nested dict of a config (for logging and checkpoint metadata)."""
    return dataclasses.asdict(config)
