"""Preflight: what can be checked before any weight loads, checked before any weight loads.

Loading the real model takes minutes; a setting that cannot work must fail before that. Both check every weight
file's header (model/weight_files.py). `training` checks the
output directory (created, writable, free space for what the run writes: `output_size`), every other folder the
run writes (cache, checkpoints, validation), the LoRA to continue from and the LoRAs kept active (model.lora.stack,
the previews'; readable, finite, matching the transformer's module names and shapes), the validation previews'
settings, the batch against the data, the process count `accelerate launch` gave; `sampling` checks the prompts'
lengths (the tokenizer alone), the LoRA files to apply and the output file's folder. The transformer's module names
come from a meta-device model built from its config.json (no weights, no memory).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from qwen_edit_core.common.files import OutputWriteError, free_bytes, temporary_name, writing
from qwen_edit_core.config import Config, to_dict

log = logging.getLogger(__name__)

#: Allowances over the tensors' own bytes, measured on the tiny model's checkpoints (48 LoRA tensors): safetensors
#: headers 119-130 B per key, torch.save 150 B per tensor, rng.pt 19.7 KB, state.json 3 KB, loss.png 14 KB; each
#: rounded up by about a quarter
HEADER_BYTES_PER_KEY = 160
TORCH_BYTES_PER_TENSOR = 256
RNG_FILE_BYTES = 24 << 10
STATE_SLACK_BYTES = 1 << 10
#: safetensors metadata of a LoRA file beside its targets list (format, type, rank, alpha, identity, steps)
LORA_METADATA_BYTES = 4 << 10
#: loss.png (a plot of a fixed size) and loss.csv's rows
PLOT_BYTES = 64 << 10
CSV_BYTES_PER_STEP = 32
#: more epochs than this is almost surely a mistake in max_steps (or a tiny dataset)
SENSIBLE_EPOCHS = 1000


def meta_transformer(model_dir: Path | None):
    """The transformer of `model_dir/transformer/config.json` on the meta device (no weights), or None when
    the model directory has no transformer config (a transformer given as one file)."""
    if model_dir is None or not (Path(model_dir) / "transformer" / "config.json").is_file():
        return None
    from accelerate import init_empty_weights

    from qwen_edit_core.families import DEFAULT, family_of
    config = DEFAULT.class_of("transformer").load_config(Path(model_dir) / "transformer")
    # the family's class, as config.json names it
    cls = family_of(config).class_of("transformer")
    with init_empty_weights():
        return cls.from_config(config)


@dataclass(frozen=True)
class OutputSize:
    """Bytes a run writes: one checkpoint, how many exist at once at most, and the files written at the end."""

    checkpoint: int
    checkpoints: int
    final: int

    @property
    def total(self) -> int:
        return self.checkpoint * self.checkpoints + self.final


def trained_tensors(config: Config, model_dir: Path, *, left_out: set | None = None
                    ) -> dict[str, tuple[int, ...]] | None:
    """{name: shape} of the adapter `model.lora` trains, injected by peft into a meta-device transformer (the
    real tensors' shapes for every adapter kind: LoRA, DoRA, LoKr, LoHa; no weights, no memory); None when the
    model directory has no transformer config. `left_out`, when given, receives the module paths the injection
    leaves out because their output reaches no loss (`adapters.lora.unreached_modules`)."""
    import torch

    from qwen_edit_core.adapters import lora
    from qwen_edit_core.families import family_of
    from qwen_edit_core.train.run import lora_spec
    # ComfyUI runs nodes under inference mode, and peft refuses to inject into inference tensors
    with torch.inference_mode(False):
        meta = meta_transformer(model_dir)
        if meta is None:
            return None
        lora.inject_lora(meta, lora_spec(config, family_of(meta)))
    if left_out is not None:
        left_out.update(lora.unreached_modules(meta))
    return {name: tuple(p.shape) for name, p in meta.named_parameters() if p.requires_grad}


def output_size(config: Config, tensors: dict[str, tuple[int, ...]], existing: int = 0) -> OutputSize:
    """What a run writes, from the trained tensors (trained in float32): a checkpoint holds them as the adapter,
    as the LoRA file, the optimizer's moments (AdamW: 2 x float32; 8-bit AdamW: 2 bytes for tensors of 4096
    elements or more), the EMA with train.ema_decay, the RNG states and state.json; up to keep_checkpoints + 1
    exist at once (the new one is written before the oldest is pruned), less the `existing` ones; at the end the
    LoRA (and its EMA twin), the loss log and plot. Validation images are not counted."""
    t = config.train
    sizes = [math.prod(shape) for shape in tensors.values()]
    data, keys = 4 * sum(sizes), len(sizes)
    moments = sum(2 * n if config.optimizer.type == "adamw8bit" and n >= 4096 else 8 * n for n in sizes)
    # the LoRA file: the tensors, an alpha per layer (counted per tensor), their keys, the metadata
    lora_file = data + keys * (4 + 2 * HEADER_BYTES_PER_KEY) + LORA_METADATA_BYTES + len(str(config.model.lora))
    state_json = len(json.dumps(to_dict(config), indent=1)) + STATE_SLACK_BYTES
    ema = data + keys * HEADER_BYTES_PER_KEY if t.ema_decay else 0
    checkpoint = (data + keys * HEADER_BYTES_PER_KEY) + lora_file + moments + 3 * keys * TORCH_BYTES_PER_TENSOR \
        + RNG_FILE_BYTES + state_json + ema
    saves = (t.max_steps // t.checkpoint_every + bool(t.max_steps % t.checkpoint_every)) if t.checkpoint_every else 1
    at_once = saves if t.keep_checkpoints <= 0 else min(t.keep_checkpoints + 1, saves)
    final = lora_file * (2 if t.ema_decay else 1) + PLOT_BYTES + CSV_BYTES_PER_STEP * t.max_steps
    return OutputSize(checkpoint, max(1, at_once - existing), final)


def check_output_dir(out_dir: Path, need_bytes: int = 0, what: str = "training outputs", key: str = "", *,
                     create: bool = True, detail: str = "") -> None:
    """Create `out_dir` (or, `create=False`, only look at it when it exists: a run's checkpoints/ folder tells
    that checkpoints exist) and write a probe file there; OutputWriteError naming the folder and its config
    `key` when it cannot be created or written (read-only, permission, a file in its way) or has less than
    `need_bytes` free (`detail` says what they are)."""
    out_dir = Path(out_dir)
    if not create and not (out_dir.exists() or out_dir.is_symlink()):
        return
    with writing(out_dir, what, key=key):
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = temporary_name(out_dir / "write-probe")
        try:
            probe.write_bytes(b"probe")
        finally:
            probe.unlink(missing_ok=True)
    free = free_bytes(out_dir)
    if free is not None and free < need_bytes:
        where = f" ({key})" if key else ""
        raise OutputWriteError(errno.ENOSPC, f"output directory {str(out_dir)!r}{where} has {free / 2**20:.1f} MiB "
                                             f"free; {what} need about {need_bytes / 2**20:.1f} MiB{detail}; free "
                                             "some space or choose another output directory")


def cache_dir(config: Config) -> tuple[Path, str]:
    """The embedding cache's folder and the key that sets it (`cache.dir`, default `train.output_dir`/cache)."""
    if config.cache.dir:
        return Path(config.cache.dir), "cache.dir"
    return Path(config.train.output_dir) / "cache", "train.output_dir (its cache/, as cache.dir is empty)"


def written_places(config: Config) -> list[tuple[Path, str, str]]:
    """(folder, config key, what goes there) for every folder a training run writes, the output directory
    first: the output directory (LoRA, loss log), the embedding cache, the checkpoints and the validation
    images and metrics (when previews or held-out pairs are on)."""
    out = Path(config.train.output_dir)
    places = [(out, "train.output_dir", "training outputs")]
    if config.cache.enabled:
        places.append((*cache_dir(config), "the embedding cache"))
    places.append((out / "checkpoints", "train.output_dir (its checkpoints/)", "checkpoints"))
    if config.train.validation_every and (config.train.validation_image or config.train.validation_pairs):
        places.append((out / "validation", "train.output_dir (its validation/)", "validation images"))
    return places


def check_lora_files(paths: Sequence[str | Path], transformer, keys: Sequence[str] = ()) -> None:
    """Each LoRA file present, readable, finite (read_lora_file refuses NaN/Inf) and, when `transformer` is
    given, matching its module names and shapes; `keys[i]` (the config key of `paths[i]`) opens its message."""
    from qwen_edit_core.adapters import lora
    for i, path in enumerate(paths):
        key = f"{keys[i]}: " if i < len(keys) else ""
        try:
            weights = lora.read_lora_file(path)
        except FileNotFoundError as err:
            raise FileNotFoundError(f"{key}{err}; give the path of an existing LoRA file") from None
        except ValueError as err:
            raise ValueError(f"{key}{err}") from None
        if transformer is not None:
            try:
                lora.check_against(transformer, weights)
            except ValueError as err:
                raise ValueError(f"{key}LoRA file {str(path)!r}: {err}") from None


def _config_loras(config: Config) -> tuple[list[str], list[str]]:
    """(paths, config keys) of the LoRA files a training run keeps active: model.lora.init_from and
    model.lora.stack (the previews' are checked with their settings, validation.previews_from_config)."""
    lora = config.model.lora
    found = [(lora.init_from, "model.lora.init_from")] if lora.init_from else []
    found += [(item.path, f"model.lora.stack[{i}]") for i, item in enumerate(lora.stack)]
    return [p for p, _ in found], [k for _, k in found]


def check_weights(config: Config, model_dir: Path | None) -> None:
    """Every weight file of the model (its directory's components, or the single files of `model.*_file`):
    headers intact, every tensor present, the shapes of the config (model/weight_files.py)."""
    from qwen_edit_core.model.weight_files import check_model_files
    from qwen_edit_core.train.run import model_files
    files = model_files(config)
    check_model_files(model_dir, ("transformer", "vae", "text_encoder"),
                      {name: files[f"{name}_file"] for name in ("transformer", "vae", "text_encoder")})


def warn_about_data(config: Config, n_examples: int) -> None:
    """Warnings for a batch larger than the data and for more epochs than sensible."""
    d, t = config.data, config.train
    if d.batch_size > n_examples:
        log.warning("data.batch_size %d is larger than the dataset (%d samples): every batch holds all of them",
                    d.batch_size, n_examples)
    samples = t.max_steps * t.gradient_accumulation_steps * min(d.batch_size, n_examples)
    epochs = samples / max(n_examples, 1)
    if epochs > SENSIBLE_EPOCHS:
        log.warning("train.max_steps %d is %.0f passes over %d samples (more than %d): check max_steps",
                    t.max_steps, epochs, n_examples, SENSIBLE_EPOCHS)


def training(config: Config, model_dir: Path | None, n_examples: int, resume: Path | None = None) -> None:
    """Every training check that needs no weights (see the module docstring): `training_inputs`, then
    `training_outputs`."""
    training_inputs(config, model_dir, n_examples, resume)
    training_outputs(config, model_dir)


#: settings a resumed run must share with its checkpoint's run: the adapter, and the optimizer and schedule
#: whose state the checkpoint holds (a changed optimizer.* or lr_scheduler.* would be silently overridden by
#: that state, or make resume inexact: refused; a new learning rate is a new run from the checkpoint's
#: lora.safetensors as model.lora.init_from)
RESUME_KEYS = ("model.variant", "model.lora.type", "model.lora.dora", "model.lora.rank", "model.lora.alpha",
               "model.lora.targets", "optimizer", "lr_scheduler")


class ResumeMismatchError(ValueError):
    """The checkpoint given to --resume cannot continue this run; the message names it and what differs."""


def _setting(tree: dict, key: str):
    for part in key.split("."):
        tree = tree.get(part, {}) if isinstance(tree, dict) else {}
    return tree


def _changed(old: dict, new: dict, key: str) -> list[str]:
    """`key: old in the checkpoint, new now` for each differing setting under `key` (the empty variant means
    detected: not compared)."""
    before, now = _setting(old, key), _setting(new, key)
    if isinstance(now, dict):
        return [line for sub in sorted(now) for line in _changed(old, new, f"{key}.{sub}")]
    if isinstance(before, list) or isinstance(now, (list, tuple)):
        before, now = list(before) if isinstance(before, (list, tuple)) else before, list(now)
    if before == now or (key == "model.variant" and "" in (before, now)):
        return []
    return [f"{key} is {before!r} in the checkpoint, {now!r} now"]


def check_resume(config: Config, model_dir: Path | None, path: Path) -> None:
    """ResumeMismatchError, one line naming checkpoint `path` and every difference, when it cannot continue this
    run: damaged or missing files (train.checkpoint.file_problems), a changed adapter, optimizer or schedule
    setting (`RESUME_KEYS`), or adapter tensors that differ in name or shape from the ones this run trains
    (another family, variant, adapter kind, rank or targets), before any weight loads."""
    from qwen_edit_core.train.checkpoint import file_problems, read_state
    shapes, problems = file_problems(path)
    if not problems:
        old = read_state(path).get("config", {})
        new = to_dict(config)
        problems = [line for key in RESUME_KEYS for line in _changed(old, new, key)]
        left_out: set[str] = set()
        expected = trained_tensors(config, model_dir, left_out=left_out)
        # a checkpoint written while the LoRA also sat on modules whose output reaches no loss resumes without them
        shapes = {k: v for k, v in shapes.items() if k in (expected or {}) or _module_of(k) not in left_out}
        if expected is not None and shapes != expected:
            problems.append(_tensor_difference(shapes, expected))
    if problems:
        raise ResumeMismatchError(f"--resume {str(path)!r} cannot continue this run: {'; '.join(problems)}. "
                                  "Resume with the checkpoint's settings, or start a new run")


def _module_of(name: str) -> str:
    from qwen_edit_core.adapters.lora import split_parameter_name
    return split_parameter_name(name)[0]


def _tensor_difference(saved: dict, expected: dict) -> str:
    """The first differences between the checkpoint's adapter tensors and this run's, in words."""
    missing, extra = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    reshaped = [f"{k} {saved[k]} vs {expected[k]}" for k in sorted(set(saved) & set(expected))
                if saved[k] != expected[k]]
    parts = ([f"{len(missing)} of this run's adapter tensors are not in it (e.g. {missing[0]})"] if missing else []) \
        + ([f"{len(extra)} of its tensors are not this run's (e.g. {extra[0]})"] if extra else []) \
        + ([f"{len(reshaped)} tensors have other shapes (e.g. {reshaped[0]})"] if reshaped else [])
    return ("its adapter is not this run's (another model family, variant, adapter kind, rank or targets): "
            + ", ".join(parts))


def training_inputs(config: Config, model_dir: Path | None, n_examples: int, resume: Path | None = None) -> None:
    """The training checks that write nothing: the launch, the data, the weight files, the resume checkpoint
    against the run (`check_resume`), the validation previews and the LoRA files (a background job runs them
    before its lock creates the output folder)."""
    from qwen_edit_core.train.distributed import launch_mismatch
    mismatch = launch_mismatch(os.environ)
    if mismatch:
        log.warning(mismatch)
    warn_about_data(config, n_examples)
    check_weights(config, model_dir)
    if resume is not None:
        check_resume(config, model_dir, resume)
    if config.train.validation_every and (config.train.validation_image or config.train.validation_previews):
        from qwen_edit_core.train.validation import previews_from_config
        previews_from_config(config)  # settings and LoRA files of every preview
    paths, keys = _config_loras(config)
    if paths:
        check_lora_files(paths, meta_transformer(model_dir), keys)


def training_outputs(config: Config, model_dir: Path | None) -> None:
    """Every folder the run writes, created and probed with a written file; the output directory with room for
    what the run writes (`output_size`)."""
    from qwen_edit_core.train.checkpoint import list_checkpoints
    out_dir = Path(config.train.output_dir)
    tensors = trained_tensors(config, model_dir)
    need, detail = 0, ""
    if tensors is not None:
        size = output_size(config, tensors, existing=len(list_checkpoints(out_dir / "checkpoints")))
        need, detail = size.total, (f" ({size.checkpoints} checkpoint(s) of {size.checkpoint / 2**20:.2f} MiB at "
                                    f"once plus {size.final / 2**20:.2f} MiB of LoRA and logs)")
    for i, (folder, key, what) in enumerate(written_places(config)):
        first = i == 0
        check_output_dir(folder, need if first else 0, what, key, create=not key.endswith("/)"),
                         detail=detail if first else "")


def check_prompts(config: Config, model_dir: Path | None, prompts: dict[str, str]) -> None:
    """EncodeError when a prompt ({what: text}) is over the text encoder's limit, counted by the model's tokenizer
    alone (no weights), as the dataset's captions are."""
    from qwen_edit_core.model.components import caption_token_counter
    from qwen_edit_core.model.encode import EncodeError
    from qwen_edit_core.families.templates import MAX_SEQUENCE_LENGTH
    from qwen_edit_core.train.run import model_files
    count = caption_token_counter(model_dir, model_files(config)["comfyui_dir"]) if prompts else None
    for what, text in prompts.items():
        tokens = count(text or "") if count else 0
        if tokens > MAX_SEQUENCE_LENGTH:
            raise EncodeError(f"{what} is {tokens} tokens; the text encoder takes at most {MAX_SEQUENCE_LENGTH}: "
                              "shorten it")


def sampling(model_dir: Path | None, loras: Sequence[str | Path], out_file: str | Path | None = None,
             config: Config | None = None, prompts: dict[str, str] | None = None) -> None:
    """Every sampling check that needs no weights: the model's weight files (given its `config`), the prompts'
    lengths ({what: text}, given the `config`), LoRA files and the output file's folder."""
    if config is not None:
        check_weights(config, model_dir)
        check_prompts(config, model_dir, prompts or {})
    if loras:
        check_lora_files(loras, meta_transformer(model_dir))
    if out_file is not None:
        check_output_dir(Path(out_file).parent, 0, what="the image")
