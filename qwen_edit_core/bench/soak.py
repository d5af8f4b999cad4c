"""Fault soak: faults injected into real training runs on the tiny model, each followed by `--resume`.

`qwen-edit bench soak --rounds N` runs, N times each with a seeded random point: a SIGKILL during caching
(inside a cache write), during a training step, and inside a checkpoint write; a SIGTERM during a training step
(the run must stop at the step boundary with a checkpoint and exit 143); two SIGTERMs during a validation pass
(the first asks for a stop, the second stops at once: the checkpoint must hold that step's boundary); a SIGTERM
inside a cache write (the run stops at once, no entry is left half-written); the run's checkpoints folder remounted
read-only during a training step (a real read-only bind mount in a private mount namespace when the soak runs as
root with `unshare`; otherwise EROFS raised at the write calls, and the table says which); a full disk inside a
checkpoint write (the kernel's own ENOSPC from /dev/full); a cache entry with flipped bytes; a second run on a
busy output directory. Kills land inside writes without timing: the child process stops at the injected point, says so
on stdout and waits; the parent then kills it. After each fault the run is finished with resume and its LoRA
compared to an uninterrupted run. Prints faults injected, runs recovered and the max difference.

The fault injection patches functions of the child process it runs in (`child`); nothing here changes the
library for anyone else.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

#: fault kind -> injected point the child stops at (None: no child process)
FAULTS = {"kill-cache": "cache-write", "kill-step": "train-step", "kill-checkpoint": "checkpoint-write",
          "sigterm-step": "train-step", "read-only": "train-step", "disk-full": "disk-full", "corrupt-cache": None,
          "second-run": "train-step", "sigterm-validation": "validation", "sigterm-cache": "cache-write"}
#: the first injected point of each kind drawn from 1..N (N: the points a 6-step run with checkpoints every 2 has)
LAST_POINT = {"cache-write": 3, "train-step": 5, "checkpoint-write": 2, "disk-full": 2, "validation": 2}
#: faults whose runs validate every 2 steps (the validation image: the dataset's first control)
VALIDATING = ("sigterm-validation",)


@dataclass
class SoakReport:
    injected: int = 0
    recovered: int = 0
    max_diff: float = 0.0
    rows: list = field(default_factory=list)


def _config(work: Path, name: str, shared_cache: bool = False, validation: bool = False):
    from qwen_edit_core import load_config
    checks = {"validation_every": 2, "validation_steps": 1, "validation_prompt": "validate",
              "validation_image": str(sorted((work / "data").glob("*_control.png"))[0])} if validation else {}
    return load_config(overrides={
        "model": {"pretrained_model_name_or_path": str(work / "model"), "lora": {"rank": 4, "alpha": 4.0,
                                                                                  "targets": "all"}},
        "data": {"folder": str(work / "data"), "vae_area": 64 * 64, "batch_size": 2},
        "cache": {"dir": str(work / ("cache" if shared_cache else f"cache-{name}"))},
        "train": {"output_dir": str(work / name), "max_steps": 6, "checkpoint_every": 2, "seed": 3, **checks},
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


def _child(work: Path, name: str, kind: str, stop_at: int, namespace: bool = False) -> subprocess.Popen:
    """The faulty run in a child process (in a mount namespace of its own with `namespace`)."""
    prefix = ["unshare", "--mount", "--propagation", "private"] if namespace else []
    return subprocess.Popen([*prefix, sys.executable, "-m", "qwen_edit_core.bench.soak", str(work), name, kind,
                             str(stop_at)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env={**os.environ, "SOAK_REAL_MOUNT": "1" if namespace else "0"})


@functools.lru_cache(maxsize=1)
def can_remount() -> bool:
    """Whether a real read-only remount works here: a bind mount remounted read-only inside a private mount
    namespace (`unshare`, as root), tried on a scratch folder."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        probe = (f"mount --bind {tmp} {tmp} && mount -o remount,bind,ro {tmp} && "
                 f"! touch {tmp}/probe 2>/dev/null")
        done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", probe],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return done.returncode == 0


def _wait_for_point(proc: subprocess.Popen, what: str = "paused") -> bool:
    """Read the child's stdout until it stops at its injected point (or says `what`: True) or exits (False)."""
    while True:
        line = proc.stdout.readline()
        if not line:
            return False
        if line.startswith(what):
            return True


def _fault(kind: str, work: Path, name: str, rng: random.Random, reference: dict) -> tuple[float, str]:
    """Inject one fault into run `name`, recover it; (difference to the reference LoRA, what happened)."""
    from qwen_edit_core.api import QwenImageEditTrainer
    from qwen_edit_core.common.files import OutputDirBusyError
    config = _config(work, name, validation=kind in VALIDATING)
    if kind == "corrupt-cache":
        QwenImageEditTrainer(config).cache()
        entry = sorted(Path(config.cache.dir).rglob("*.safetensors"))[rng.randrange(4)]
        data = bytearray(entry.read_bytes())
        data[len(data) - 1 - rng.randrange(64)] ^= 0x20
        entry.write_bytes(bytes(data))
        return _diff(_lora(_finish(config)), reference), "entry recomputed"
    point = FAULTS[kind]
    stop_at = rng.randint(1, LAST_POINT[point])
    real_mount = kind == "read-only" and can_remount()
    proc = _child(work, name, kind, stop_at, namespace=real_mount)
    note = f"{point} #{stop_at}"
    if kind in ("disk-full", "read-only"):  # the child meets the fault alone and ends
        out, _ = proc.communicate(timeout=1800)
        failed = next((line[8:90] for line in out.splitlines() if line.startswith("failed: ")), "no error")
        how = ("checkpoints/ remounted read-only (real bind mount)" if real_mount
               else "EROFS injected at the write calls under checkpoints/ (no mount namespace)")
        note += (f", {how}" if kind == "read-only" else "") + f", exit {proc.returncode}: {failed}"
    elif not _wait_for_point(proc):
        raise RuntimeError(f"soak child for {kind} exited before its injected point")
    elif kind == "second-run":
        try:
            QwenImageEditTrainer(config).fit()
            raise RuntimeError("a second run on a busy output directory was not refused")
        except OutputDirBusyError:
            note += ", second run refused"
        _release(proc)
        return _diff(_lora(Path(config.train.output_dir) / "lora.safetensors"), reference), note
    elif kind in ("sigterm-validation", "sigterm-cache"):
        proc.send_signal(signal.SIGTERM)
        if kind == "sigterm-validation":  # the second once the first was taken (signals do not queue)
            if not _wait_for_point(proc, "cancelled"):
                raise RuntimeError("soak child for sigterm-validation exited before taking the first SIGTERM")
            proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=1800)
        note += f", exit {proc.returncode}, {_checkpoints(config)}"
        if proc.returncode != 128 + signal.SIGTERM:
            return float("inf"), note
    elif kind == "sigterm-step":
        proc.send_signal(signal.SIGTERM)  # while the child waits inside the step: it ends the step, then stops
        _release(proc)
        note += f", exit {proc.returncode}, {_checkpoints(config)}"
        if proc.returncode != 128 + signal.SIGTERM:
            return float("inf"), note
    else:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    return _diff(_lora(_finish(config)), reference), note


def _release(proc: subprocess.Popen) -> None:
    """Let a child paused at its injected point go on, and wait for it to end."""
    proc.stdin.write("\n")
    proc.stdin.flush()
    proc.wait(timeout=1800)


def _checkpoints(config) -> str:
    from qwen_edit_core.train.checkpoint import list_checkpoints
    steps = [c.step for c in list_checkpoints(Path(config.train.output_dir) / "checkpoints")]
    return f"checkpoints at steps {steps}"


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


def _read_only(out: Path, real: bool):
    """Make folder `out` read-only now: remount its bind mount (`real`, inside the child's mount namespace), or
    make every write under it raise EROFS (the child's `open` and safetensors' `save_file`)."""
    if real:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(out)], check=True)
        return
    import builtins

    import safetensors.torch as st
    real_open, real_save = builtins.open, st.save_file

    def refuse(path, mode="r"):
        if str(out) in os.path.abspath(str(path)) and any(m in mode for m in "wax+"):
            raise OSError(errno.EROFS, "Read-only file system (injected)", str(path))

    def guarded_open(file, mode="r", *a, **k):
        refuse(file, mode) if isinstance(file, (str, os.PathLike)) else None
        return real_open(file, mode, *a, **k)

    def guarded_save(tensors, path, metadata=None):
        refuse(path, "w")
        return real_save(tensors, path, metadata=metadata)
    builtins.open, st.save_file = guarded_open, guarded_save


def _inject(point: str, kind: str, name: str, stop_at: int, out: Path, counter: list) -> None:
    """Patch this (child) process so the run stops (or meets its fault) at the `stop_at`-th `point`."""
    import safetensors.torch as st

    import qwen_edit_core.train.checkpoint as ckpt
    import qwen_edit_core.train.loop as loop
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
            if kind == "read-only":
                counter[0] += 1
                if counter[0] == stop_at:
                    _read_only(out, real=os.environ.get("SOAK_REAL_MOUNT") == "1")
            else:
                _pause(point, stop_at, counter)
            real_step(run)
        loop.optimizer_step = optimizer_step
    elif point == "validation":
        import qwen_edit_core.train.validation as validation
        real_validate = validation.Validator.__call__

        def validate(self, step, write=True):
            written = real_validate(self, step, write)
            _pause(point, stop_at, counter)  # the pass is done, the loop has not yet gone on
            return written
        validation.Validator.__call__ = validate
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


def child(work: Path, name: str, kind: str, stop_at: int) -> int:
    """The faulty run: train `name` and meet fault `kind` at its `stop_at`-th point; the exit status (a run that
    fails prints `failed: <error>` on stdout)."""
    from qwen_edit_core.api import QwenImageEditTrainer
    from qwen_edit_core.common.progress import SignalStop
    config = _config(work, name, validation=kind in VALIDATING)
    out = Path(config.train.output_dir).resolve()
    # The checkpoints folder becomes read-only: the output folder itself holds the run's lock file, open for
    # writing all run long, and the kernel refuses (EBUSY) to remount a mount read-only while a file is open
    # for writing on it.
    target = out / "checkpoints"
    if kind == "read-only" and os.environ.get("SOAK_REAL_MOUNT") == "1":  # in a mount namespace of its own
        target.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "--bind", str(target), str(target)], check=True)
    _inject(FAULTS[kind], kind, name, stop_at, target, [0])
    cancel = _announced_cancel()
    try:
        with SignalStop(cancel) as stop:  # as `qwen-edit train` runs
            result = QwenImageEditTrainer(config).fit(progress=stop.progress(), cancel=cancel)
    except KeyboardInterrupt as err:  # a signal before training (or a second one): stopped at once
        return 128 + getattr(err, "signum", signal.SIGINT)
    except Exception as err:  # noqa: BLE001 (the parent reports it)
        print(f"failed: {type(err).__name__}: {err}", flush=True)
        return 2
    return 128 + stop.received if result.state == "cancelled" else 0


def _announced_cancel():
    from qwen_edit_core.common.progress import CancelToken

    class Announced(CancelToken):
        """A cancel token that says on stdout when a signal cancelled it (the parent sends a second after)."""

        def cancel(self) -> None:
            super().cancel()
            print("cancelled", flush=True)
    return Announced()


if __name__ == "__main__":
    sys.exit(child(Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])))
