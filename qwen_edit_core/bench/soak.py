"""Fault soak: faults injected into real training runs on the tiny model, each followed by `--resume`.

`qwen-edit bench soak --rounds N` runs, N times each with a seeded random point: a SIGKILL during caching (inside
a cache write), during a training step, and inside a checkpoint write; a full disk inside a checkpoint write
(the kernel's own ENOSPC from /dev/full); a cache entry with flipped bytes; a second run on a busy output
directory. Kills land inside writes without timing: the child process stops at the injected point, says so
on stdout and waits; the parent then kills it. After each fault the run is finished with resume and its LoRA
compared to an uninterrupted run. Prints faults injected, runs recovered and the max difference.

The fault injection patches functions of the child process it runs in (`child`); nothing here changes the
library for anyone else.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

#: fault kind -> injected point the child stops at (None: no child process)
FAULTS = {"kill-cache": "cache-write", "kill-step": "train-step", "kill-checkpoint": "checkpoint-write",
          "disk-full": None, "corrupt-cache": None, "second-run": "train-step"}


@dataclass
class SoakReport:
    injected: int = 0
    recovered: int = 0
    max_diff: float = 0.0
    rows: list = field(default_factory=list)


def _config(work: Path, name: str, shared_cache: bool = False):
    from qwen_edit_core import load_config
    return load_config(overrides={
        "model": {"pretrained_model_name_or_path": str(work / "model"), "lora": {"rank": 4, "alpha": 4.0,
                                                                                  "targets": "all"}},
        "data": {"folder": str(work / "data"), "vae_area": 64 * 64, "batch_size": 2},
        "cache": {"dir": str(work / ("cache" if shared_cache else f"cache-{name}"))},
        "train": {"output_dir": str(work / name), "max_steps": 6, "checkpoint_every": 2, "seed": 3},
        "optimizer": {"lr": 1e-3}})


def _lora(path: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(path)


def _diff(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _finish(config) -> Path:
    """Resume the run from its latest checkpoint (or start it again when none was written)."""
    from qwen_edit_core.api import QwenImageEditTrainer
    from qwen_edit_core.train.checkpoint import latest_checkpoint
    has = latest_checkpoint(Path(config.train.output_dir) / "checkpoints") is not None
    return QwenImageEditTrainer(config).fit(resume=True if has else None).lora_path


def _child(work: Path, name: str, point: str, stop_at: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "qwen_edit_core.bench.soak", str(work), name, point,
                             str(stop_at)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)


def _wait_for_point(proc: subprocess.Popen) -> bool:
    """Read the child's stdout until it stops at its injected point (True) or exits (False)."""
    while True:
        line = proc.stdout.readline()
        if not line:
            return False
        if line.startswith("paused"):
            return True


def _fault(kind: str, work: Path, name: str, rng: random.Random, reference: dict) -> tuple[float, str]:
    """Inject one fault into run `name`, recover it; (difference to the reference LoRA, what happened)."""
    from qwen_edit_core.api import QwenImageEditTrainer
    from qwen_edit_core.common.files import OutputDirBusyError
    config = _config(work, name)
    if kind == "corrupt-cache":
        QwenImageEditTrainer(config).cache()
        entry = sorted(Path(config.cache.dir).rglob("*.safetensors"))[rng.randrange(4)]
        data = bytearray(entry.read_bytes())
        data[len(data) - 1 - rng.randrange(64)] ^= 0x20
        entry.write_bytes(bytes(data))
        return _diff(_lora(_finish(config)), reference), "entry recomputed"
    point = FAULTS[kind] if kind != "disk-full" else "disk-full"
    stop_at = {"cache-write": rng.randint(1, 3), "train-step": rng.randint(1, 5),
               "checkpoint-write": rng.randint(1, 2), "disk-full": rng.randint(1, 2)}[point]
    proc = _child(work, name, point, stop_at)
    note = f"{point} #{stop_at}"
    if point == "disk-full":
        proc.wait(timeout=1800)
        note += f", exit {proc.returncode}"
    elif not _wait_for_point(proc):
        raise RuntimeError(f"soak child for {kind} exited before its injected point")
    elif kind == "second-run":
        try:
            QwenImageEditTrainer(config).fit()
            raise RuntimeError("a second run on a busy output directory was not refused")
        except OutputDirBusyError:
            note += ", second run refused"
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=1800)
        return _diff(_lora(Path(config.train.output_dir) / "lora.safetensors"), reference), note
    else:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    return _diff(_lora(_finish(config)), reference), note


def soak(rounds: int = 1, faults: tuple[str, ...] = tuple(FAULTS), seed: int = 0,
         work: Path | None = None) -> SoakReport:
    """Run every fault in `faults` `rounds` times on the tiny model; returns the counts."""
    from qwen_edit_core.demo import write_dataset
    from qwen_edit_core.model.tiny import build_tiny
    rng = random.Random(seed)
    report = SoakReport()
    with tempfile.TemporaryDirectory(prefix="qwen-edit-soak-") as tmp:
        work = Path(work or tmp)
        build_tiny(work / "model")
        write_dataset(work / "data", 4, seed)
        reference = _lora(_finish(_config(work, "reference")))
        for r in range(rounds):
            for kind in faults:
                report.injected += 1
                diff, note = _fault(kind, work, f"{kind}-{r}", rng, reference)
                report.recovered += diff == 0.0
                report.max_diff = max(report.max_diff, diff)
                report.rows.append((kind, note, diff))
                log.info("soak %s (%s): max difference to the uninterrupted run %.3g", kind, note, diff)
    return report


def run(rounds: int = 1) -> SoakReport:
    """`qwen-edit bench soak`: the soak with its table on stdout."""
    report = soak(rounds)
    lines = ["| fault | injected at | max |LoRA - uninterrupted| |", "|---|---|---|"]
    lines += [f"| {kind} | {note} | {diff:.3g} |" for kind, note, diff in report.rows]
    lines.append(f"faults injected: {report.injected}; runs recovered bit-exactly: {report.recovered}; "
                 f"max difference: {report.max_diff:.3g}")
    sys.stdout.write("\n".join(lines) + "\n")
    return report


def _pause(point: str, stop_at: int, counter: list) -> None:
    counter[0] += 1
    if counter[0] == stop_at:
        print(f"paused {point} {counter[0]}", flush=True)
        sys.stdin.readline()


def child(work: Path, name: str, point: str, stop_at: int) -> None:
    """The faulty run: train `name` and stop at the `stop_at`-th `point` (or fill the disk there)."""
    import safetensors.torch as st

    import qwen_edit_core.train.checkpoint as ckpt
    import qwen_edit_core.train.loop as loop
    from qwen_edit_core.api import QwenImageEditTrainer
    counter = [0]
    if point == "cache-write":
        real_save = st.save_file

        def save_file(tensors, path, metadata=None):
            real_save(tensors, path, metadata=metadata)  # whole in its temporary file, not yet renamed
            if os.sep + f"cache-{name}" + os.sep in str(path):
                _pause(point, stop_at, counter)
        st.save_file = save_file
    elif point == "train-step":
        real_step = loop.optimizer_step

        def optimizer_step(run):
            _pause(point, stop_at, counter)
            real_step(run)
        loop.optimizer_step = optimizer_step
    elif point in ("checkpoint-write", "disk-full"):
        real_torch_save = ckpt.torch.save

        def torch_save(obj, fh, *a, **k):
            if fh.name.endswith("optimizer.pt"):
                counter[0] += 1
                if counter[0] == stop_at and point == "disk-full":
                    with open("/dev/full", "wb") as full:
                        return real_torch_save(obj, full, *a, **k)
                counter[0] -= 1
                real_torch_save(obj, fh, *a, **k)
                fh.flush()
                return _pause(point, stop_at, counter)  # the optimizer file is written, the checkpoint is not
            return real_torch_save(obj, fh, *a, **k)
        ckpt.torch.save = torch_save
    QwenImageEditTrainer(_config(work, name)).fit()


if __name__ == "__main__":
    child(Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]))
