"""Preflight: what can be checked before any weight loads, checked before any weight loads.

Loading the real model takes minutes; a setting that cannot work must fail before that. `training` checks the
output directory (created, writable, free space for one checkpoint plus the LoRA), the LoRA to continue from
(readable, finite, matching the transformer's module names and shapes), the batch against the data; `sampling`
checks the LoRA files to apply and the output file's folder. The transformer's module names come from a
meta-device model built from its config.json (no weights, no memory).
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path
from typing import Sequence

from qwen_edit_core.common.files import OutputWriteError, free_bytes, temporary_name, writing
from qwen_edit_core.config import Config

log = logging.getLogger(__name__)

#: bytes per trainable LoRA parameter written by one checkpoint plus the final LoRA: adapter (fp32), the
#: checkpoint's LoRA file (fp32), AdamW's two moments (fp32), the final LoRA file (fp32)
BYTES_PER_PARAMETER = 4 + 4 + 8 + 4
#: slack for state.json, rng.pt, the loss log and plot
SLACK_BYTES = 4 << 20
#: more epochs than this is almost surely a mistake in max_steps (or a tiny dataset)
SENSIBLE_EPOCHS = 1000


def meta_transformer(model_dir: Path | None):
    """The transformer of `model_dir/transformer/config.json` on the meta device (no weights), or None when
    the model directory has no transformer config (a transformer given as one file)."""
    if model_dir is None or not (Path(model_dir) / "transformer" / "config.json").is_file():
        return None
    from accelerate import init_empty_weights
    from diffusers import QwenImageTransformer2DModel
    with init_empty_weights():
        return QwenImageTransformer2DModel.from_config(
            QwenImageTransformer2DModel.load_config(Path(model_dir) / "transformer"))


def lora_parameters(transformer, targets: Sequence[str], rank: int) -> int:
    """Trainable parameters of a rank-`rank` LoRA on the `targets` of `transformer` (a meta model is enough)."""
    from qwen_edit_core.adapters import lora
    modules = lora.adaptable_modules(transformer)
    return sum(rank * (modules[n].in_features + modules[n].out_features)
               for n in lora._matching_modules(transformer, targets))


def check_output_dir(out_dir: Path, need_bytes: int = 0, what: str = "training outputs") -> None:
    """Create `out_dir` and write a probe file there; OutputWriteError when it cannot be written or has less
    than `need_bytes` free."""
    out_dir = Path(out_dir)
    with writing(out_dir, what):
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = temporary_name(out_dir / "write-probe")
        try:
            probe.write_bytes(b"probe")
        finally:
            probe.unlink(missing_ok=True)
    free = free_bytes(out_dir)
    if free is not None and free < need_bytes:
        raise OutputWriteError(errno.ENOSPC, f"output directory {str(out_dir)!r} has {free / 2**20:.1f} MiB free; "
                                             f"{what} need about {need_bytes / 2**20:.1f} MiB (one checkpoint "
                                             "plus the LoRA); free some space or choose another output directory")


def check_lora_files(paths: Sequence[str | Path], transformer) -> None:
    """Each LoRA file readable, finite (read_lora_file refuses NaN/Inf) and, when `transformer` is given,
    matching its module names and shapes."""
    from qwen_edit_core.adapters import lora
    for path in paths:
        weights = lora.read_lora_file(path)
        if transformer is not None:
            try:
                lora.check_against(transformer, weights)
            except ValueError as err:
                raise ValueError(f"LoRA file {str(path)!r}: {err}") from None


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


def training(config: Config, model_dir: Path | None, n_examples: int) -> None:
    """Every training check that needs no weights (see the module docstring)."""
    from qwen_edit_core.adapters import lora
    warn_about_data(config, n_examples)
    meta = meta_transformer(model_dir)
    need = SLACK_BYTES
    if meta is not None:
        spec = config.model.lora
        need += BYTES_PER_PARAMETER * lora_parameters(meta, lora.resolve_targets(spec.targets), spec.rank)
    check_output_dir(Path(config.train.output_dir), need)
    if config.model.lora.init_from:
        check_lora_files([config.model.lora.init_from], meta)


def sampling(model_dir: Path | None, loras: Sequence[str | Path], out_file: str | Path | None = None) -> None:
    """Every sampling check that needs no weights: LoRA files and the output file's folder."""
    if loras:
        check_lora_files(loras, meta_transformer(model_dir))
    if out_file is not None:
        check_output_dir(Path(out_file).parent, 0, what="the image")
