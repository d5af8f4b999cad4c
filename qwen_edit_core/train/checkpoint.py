"""Training checkpoints: written whole or not at all, found by their own metadata, the last K kept.

A checkpoint is a directory `checkpoints/step-0000012/` (the step, seven digits) holding `adapter.safetensors` (the
trainable LoRA parameters by name, float32, exact), `lora.safetensors` (the ComfyUI/diffusers file users load),
`optimizer.pt` and `rng.pt` (tensors only; read with `weights_only=True`), `ema.safetensors` (the LoRA's moving average,
with `train.ema_decay`) and `state.json` (step, LR scheduler, data position, config). It is assembled under a temporary
name and renamed into place, so a process killed mid-write leaves only a temporary directory that resume ignores and the
next save removes.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from qwen_edit_core.common.files import save_safetensors, writing

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
EMA_FILE = "ema.safetensors"
CHECKPOINT_FORMAT = 1


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    state: dict


def cuda_index(device: torch.device | str | None) -> int | None:
    """The CUDA device whose generator a run on `device` draws from (LoRA dropout runs on the transformer's
    device), or None for a non-CUDA device. A bare "cuda" means the current device."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def rng_state(device: torch.device | str | None = None) -> dict:
    """Every RNG the loop may touch: torch's CPU generator (peft dropout on the CPU), Python's, numpy's and the
    generator of the training `device` when it is a GPU (dropout there). Only that device's generator:
    `get_rng_state_all` would create a CUDA context on every visible GPU from every process, and the current
    device need not be the training one (a run on cuda:1)."""
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": repr(random.getstate()),
             "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
             "numpy_meta": torch.tensor([np_state[2], np_state[3]], dtype=torch.int64),
             "numpy_gauss": torch.tensor([np_state[4]], dtype=torch.float64)}
    index = cuda_index(device)
    if index is not None:
        state["cuda"] = torch.cuda.get_rng_state(index)
        state["cuda_index"] = torch.tensor([index])
    return state


def set_rng_state(state: dict, device: torch.device | str | None = None) -> None:
    """Restore `rng_state`'s generators; the saved GPU generator goes to this run's training `device` (which
    may be another index than the saving run's)."""
    torch.set_rng_state(state["torch"])
    import ast
    random.setstate(_tuplify(ast.literal_eval(state["python"])))
    meta = state["numpy_meta"].tolist()
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), meta[0], meta[1],
                         float(state["numpy_gauss"][0])))
    index = cuda_index(device)
    if "cuda" in state and index is not None:
        cuda = state["cuda"]
        if cuda.dim() == 2:  # written by earlier versions: one row per visible GPU
            cuda = cuda[min(index, cuda.shape[0] - 1)]
        torch.cuda.set_rng_state(cuda, index)


def _tuplify(value):
    return tuple(_tuplify(v) for v in value) if isinstance(value, (list, tuple)) else value


def save_checkpoint(root: Path, step: int, *, adapter: dict[str, torch.Tensor], optimizer: dict, state: dict,
                    write_lora, ema: dict[str, torch.Tensor] | None = None,
                    device: torch.device | str | None = None) -> Path:
    """Write checkpoint `step` under `root` atomically; `write_lora(path)` writes the user-facing LoRA file;
    `ema` (the LoRA's moving average by parameter name) goes to `ema.safetensors`; the RNG states include the
    training `device`'s generator. A full disk, read-only folder or denied permission raises OutputWriteError
    naming what survived."""
    final = root / f"step-{step:07d}"
    with writing(final, f"checkpoint step {step}", survivor(root)):
        root.mkdir(parents=True, exist_ok=True)
        _remove_partials(root)
        tmp = root / f".partial-{step:07d}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            save_safetensors(adapter, tmp / "adapter.safetensors")
            if ema is not None:
                save_safetensors(ema, tmp / EMA_FILE)
            write_lora(tmp / "lora.safetensors")
            _torch_save(optimizer, tmp / "optimizer.pt")
            _torch_save(rng_state(device), tmp / "rng.pt")
            (tmp / STATE_FILE).write_text(json.dumps({**state, "step": step, "format": CHECKPOINT_FORMAT}, indent=1))
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log.info("checkpoint step %d -> %s", step, final)
    return final


def _torch_save(obj, path: Path) -> None:
    """torch.save through a Python file, so a full disk raises OSError with its errno (torch.save to a path
    reports only "basic_ios::clear: iostream error")."""
    with open(path, "wb") as fh:
        torch.save(obj, fh)


def survivor(root: Path) -> str:
    """What a failed write leaves for resume: the newest complete checkpoint under `root`, if any."""
    found = latest_checkpoint(root)
    if found is None:
        return "No earlier checkpoint exists; the run's other files are unchanged."
    return f"The checkpoint at step {found.step} is intact ({found.path}); continue from it with --resume."


def _fsync_dir(path: Path) -> None:
    for child in path.iterdir():
        with open(child, "rb") as fh:
            os.fsync(fh.fileno())


def _remove_partials(root: Path) -> None:
    for child in root.glob(".partial-*"):
        shutil.rmtree(child, ignore_errors=True)


def list_checkpoints(root: Path) -> list[Checkpoint]:
    """Complete checkpoints under `root`, oldest first, identified by their state.json (not their names)."""
    found = []
    if not root.is_dir():
        return found
    for child in root.iterdir():
        state_path = child / STATE_FILE
        if child.name.startswith(".") or not state_path.is_file():
            continue
        try:
            state = json.loads(state_path.read_text())
        except (OSError, json.JSONDecodeError):
            log.warning("ignoring unreadable checkpoint %s", child)
            continue
        found.append(Checkpoint(child, int(state["step"]), state))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(root: Path) -> Checkpoint | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def read_checkpoint(path: Path) -> tuple[Checkpoint, dict[str, torch.Tensor], dict, dict]:
    """(checkpoint, adapter tensors, optimizer state, rng state) of a checkpoint directory."""
    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a complete checkpoint (no {STATE_FILE}); "
                                "give a checkpoints/step-N directory or the run's output directory")
    state = json.loads((path / STATE_FILE).read_text())
    adapter = load_file(path / "adapter.safetensors")
    optimizer = torch.load(path / "optimizer.pt", weights_only=True)
    rng = torch.load(path / "rng.pt", weights_only=True)
    return Checkpoint(path, int(state["step"]), state), adapter, optimizer, rng


def saved_order(module_order: list[str], saved: list[str], live: list[str], split) -> list[str]:
    """The names `saved` (a checkpoint's adapter parameters, in any order) in the order the optimizer saw them:
    the model's registration order, rebuilt from `module_order` (the model's module paths in order, which still
    lists modules that carry no LoRA now) and, inside one module, the order of the parameter suffixes in `live`
    (this run's parameter names, in order). `split(name)` gives (module path, suffix)."""
    position = {m: i for i, m in enumerate(module_order)}
    suffixes: list[str] = []
    for name in live:
        suffix = split(name)[1]
        if suffix not in suffixes:
            suffixes.append(suffix)

    def key(name: str) -> tuple[int, int]:
        module, suffix = split(name)
        if module not in position or suffix not in suffixes:
            raise ValueError(f"checkpoint parameter {name!r}: no such module or adapter tensor in this model; "
                             "resume with the same model and model.lora settings")
        return position[module], suffixes.index(suffix)
    return sorted(saved, key=key)


def narrow_optimizer_state(state: dict, saved: list[str], kept: list[str]) -> dict:
    """An optimizer state dict over the parameters `saved` (in the optimizer's order, one parameter group)
    restricted to `kept`, a subsequence of `saved`, and renumbered: a checkpoint written while the LoRA held
    parameters this version leaves out (`adapters.lora.unreached_modules`) loads into the smaller optimizer."""
    groups = state["param_groups"]
    if len(groups) != 1 or len(groups[0]["params"]) != len(saved):
        raise ValueError(f"the checkpoint's optimizer holds {sum(len(g['params']) for g in groups)} parameters in "
                         f"{len(groups)} group(s) and its adapter {len(saved)}: resume with the same model.lora "
                         "settings")
    index = {name: i for i, name in enumerate(saved)}
    old = [groups[0]["params"][index[name]] for name in kept]
    return {"state": {new: state["state"][i] for new, i in enumerate(old) if i in state["state"]},
            "param_groups": [{**groups[0], "params": list(range(len(kept)))}]}


#: the files every complete checkpoint holds (ema.safetensors only with train.ema_decay)
REQUIRED_FILES = ("adapter.safetensors", "lora.safetensors", "optimizer.pt", "rng.pt", STATE_FILE)


def file_problems(path: Path) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """({adapter tensor: shape}, problems) of a checkpoint directory, read without any model: a missing file, a
    safetensors file whose header or size is wrong (model/weight_files.py), an optimizer or RNG file torch cannot
    read (cut short, not torch's), a state.json that is not JSON."""
    from qwen_edit_core.model.weight_files import header_problems
    path, problems, shapes = Path(path), [], {}
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    problems += [f"{name} is missing" for name in missing]
    for name in ("adapter.safetensors", "lora.safetensors", EMA_FILE):
        if (path / name).is_file():
            entries, bad = header_problems(path / name)
            problems += [f"{name}: {problem}" for problem in bad]
            if name == "adapter.safetensors":
                shapes = {key: tuple(entry["shape"]) for key, entry in entries.items()}
    for name in ("optimizer.pt", "rng.pt"):
        if name not in missing:
            try:
                torch.load(path / name, weights_only=True)
            except Exception as err:  # noqa: BLE001 - a damaged file makes torch raise several types
                first_line = (str(err).splitlines() or [""])[0][:120]
                problems.append(f"{name} cannot be read ({type(err).__name__}: {first_line})")
    if STATE_FILE not in missing:
        try:
            read_state(path)
        except (OSError, ValueError) as err:
            problems.append(f"{STATE_FILE} cannot be read ({err})")
    return shapes, problems


def read_ema(path: Path, params) -> dict[str, torch.Tensor]:
    """The EMA tensors of a checkpoint directory; a checkpoint of a run without train.ema_decay starts the
    average from the restored parameters (logged)."""
    file = Path(path) / EMA_FILE
    if not file.is_file():
        log.warning("checkpoint %s has no %s (trained without train.ema_decay): the EMA starts from the restored "
                    "LoRA", path, EMA_FILE)
        return {name: p.detach().float().cpu() for name, p in params.items()}
    return load_file(file)


def prune(root: Path, keep: int, run_id: str | None = None) -> None:
    """Remove all but the newest `keep` checkpoints of run `run_id` (keep <= 0 keeps all); another run's
    checkpoints are never removed."""
    if keep <= 0:
        return
    own = [c for c in list_checkpoints(root) if c.state.get("run_id") == run_id]
    for old in own[:-keep]:
        shutil.rmtree(old.path, ignore_errors=True)


def read_state(path: Path) -> dict:
    """A checkpoint directory's state.json (step, run id, schedule, data position, config)."""
    return json.loads((Path(path) / STATE_FILE).read_text())


def lora_stack(configured: tuple, resume: Path | None) -> tuple[tuple[str, float], ...]:
    """The companion LoRAs ((path, strength) pairs) to train with: `model.lora.stack`, or, when resuming with no
    stack configured, the stack the checkpoint's run trained with (its state.json config). A configured stack
    that differs from the checkpoint's is an error: the trained LoRA was fitted on top of the other one."""
    stack = tuple((item.path, float(item.strength)) for item in configured)
    if resume is None:
        return stack
    state = json.loads((Path(resume) / STATE_FILE).read_text())
    lora = state.get("config", {}).get("model", {}).get("lora", {})
    recorded = tuple((item["path"], float(item["strength"])) for item in lora.get("stack", ()))
    if stack and recorded != stack:
        raise ValueError(f"model.lora.stack {list(stack)} differs from the stack checkpoint {str(resume)!r} was "
                         f"trained with {list(recorded)}: resume with that stack (or leave model.lora.stack empty)")
    return stack or recorded
