"""What a background training job (jobs.py) runs of the trainer: its preflight, in two parts, its fit, and the
checkpoint it resumes from.

A job's preflight is a `Preflight`: `check(config, resume)` writes nothing (the model, the dataset, the config)
and runs before the job's lock creates the output folder, so a config that cannot work leaves no folder behind;
`probe(config, resume)` runs with the lock held (the output folder and every other folder the run writes:
writable, with room for the run's files). A plain callable given as a job's preflight is its `check` alone.
A job asked to overwrite another run's files (train.run_folder) calls its check and its fit with `overwrite=True`;
other jobs call them without the keyword.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from qwen_edit_core.config import Config

#: check(config, resume[, overwrite=True]) or probe(config, resume): raises naming the bad input, returns None when
#: it is fine
Check = Callable[[Config, object], None]


def fit_with_trainer(config: Config, *, resume, progress, cancel, lock=None, model=None, overwrite: bool = False):
    """The default run of a job: `QwenImageEditTrainer(config).fit(...)`, returning its TrainResult. `lock`: the
    output directory's lock, already held by the job; `model`: loaded components the run trains on (shared,
    not loaded again; their encoders serve the cache stage); `overwrite`: another run's files in the output
    folder are moved aside first."""
    import torch

    from qwen_edit_core.api import QwenImageEditTrainer
    trainer = QwenImageEditTrainer(config)
    trainer.components = model
    # A new thread starts outside inference mode; say so anyway, training needs autograd.
    with torch.inference_mode(False):
        return trainer.fit(resume=resume, progress=progress, cancel=cancel, lock=lock, shared=model,
                           overwrite=overwrite)


def check_with_trainer(config: Config, resume, overwrite: bool = False) -> None:
    """The default preflight's checks that write nothing, before any weight loads
    (`QwenImageEditTrainer.check_fit_inputs`: the model, the dataset, the config, the resume checkpoint, another
    run's files in the output folder unless `overwrite`)."""
    from qwen_edit_core.api import QwenImageEditTrainer
    QwenImageEditTrainer(config).check_fit_inputs(resume=resume, overwrite=overwrite)


def probe_with_trainer(config: Config, resume) -> None:
    """The default preflight's probe of the folders the run writes (`QwenImageEditTrainer.check_fit_outputs`)."""
    from qwen_edit_core.api import QwenImageEditTrainer
    QwenImageEditTrainer(config).check_fit_outputs()


def resumed_checkpoint(output_dir: Path, resume) -> Path | None:
    """The checkpoint a run resumes from (read once, when the job starts), None for a fresh run."""
    if not resume:
        return None
    from qwen_edit_core.train.loop import resolve_resume
    try:
        return resolve_resume(output_dir, resume)
    except (OSError, ValueError):
        return None  # the run itself reports what is wrong with it


@dataclass(frozen=True)
class Preflight:
    """A job's checks before it trains: `check` before its lock creates the output folder (it must write
    nothing), `probe` (optional) with the lock held."""

    check: Check
    probe: Check | None = None

    @staticmethod
    def of(preflight: "Preflight | Check") -> "Preflight":
        """`preflight` as a Preflight (a plain callable is a check alone)."""
        return preflight if isinstance(preflight, Preflight) else Preflight(check=preflight)


#: The trainer's preflight (`QwenImageEditTrainer.check_fit`, split where it starts writing).
TRAINER_PREFLIGHT = Preflight(check=check_with_trainer, probe=probe_with_trainer)
