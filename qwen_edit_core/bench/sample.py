"""`qwen-edit bench sample`: every family's sampling tables (each family's `sample_bench` stage module: its `run`
prints its own), and the measurements any family's tables share: where an edit's seconds go (`stage_times`), a step's
host syncs and new CUDA segments (`step_hygiene`), whether compiled blocks ran eager (`eager_note`).
"""

from __future__ import annotations

import time

import torch

from qwen_edit_core import speed

from qwen_edit_core.bench.common import sync


def step_hygiene(fn, device: torch.device) -> tuple[int, int]:
    """(host syncs, new CUDA memory segments) of one call of `fn` after a warm-up call: the denoising step
    should need neither (torch.cuda.set_sync_debug_mode warns at each synchronizing op; a new segment is a
    cudaMalloc). (-1, -1) off CUDA."""
    import warnings
    if device.type != "cuda":
        return -1, -1
    fn()
    sync(device)
    segments = torch.cuda.memory_stats(device)["segment.all.allocated"]
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    sync(device)
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return syncs, torch.cuda.memory_stats(device)["segment.all.allocated"] - segments


#: the stages of one edit with our sampler: (label, module, function name), the module a dotted path or the name
#: of a stage module of the bench model's family (`Family.stage`); whatever else the edit spends (scheduler,
#: noise, host copies, recompiles) is "other"
STAGES = (("prompt encoding", "encode", "encode_prompts"),
          ("VAE encode", "qwen_edit_core.model.encode", "encode_latents"),
          ("denoising", "sampler", "denoise"),
          ("VAE decode", "sampler", "decode"))


def stage_times(fn, device: torch.device, family) -> tuple[object, dict[str, float]]:
    """(fn's result, seconds per stage of `STAGES` plus "other") of one call of `fn` (an edit with our sampler).
    Each stage's function is wrapped for the call alone (the device synchronised around it, four syncs in all)
    and restored afterwards."""
    import importlib
    spent = {label: 0.0 for label, _, _ in STAGES}
    saved = []

    def timed(label, real):
        def call(*args, **kwargs):
            sync(device)
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                sync(device)
                spent[label] += time.perf_counter() - start
        return call
    for label, module, name in STAGES:
        mod = importlib.import_module(module) if "." in module else family.stage(module)
        saved.append((mod, name, getattr(mod, name)))
        setattr(mod, name, timed(label, getattr(mod, name)))
    sync(device)
    start = time.perf_counter()
    try:
        out = fn()
        sync(device)
    finally:
        for mod, name, real in saved:
            setattr(mod, name, real)
    spent["other"] = time.perf_counter() - start - sum(spent.values())
    return out, spent


def stages_text(spent: dict[str, float]) -> str:
    """`stage_times`' seconds as one table cell."""
    return ", ".join(f"{label} {s:.2f}" for label, s in spent.items())


def eager_note(transformer) -> str:
    """What a row's name gains when its compiled blocks fell back to eager (its time is then not compiled)."""
    stats = speed.compile_stats(transformer)
    return f" (ran eager: {stats.fallback})" if stats is not None and stats.fallback else ""


def run(real_size: bool = False, device: str = "cpu", steps: int = 4, repeats: int = 3) -> str:
    """Every family's sampling table(s) (each family's families/<family>/sample_bench.py `run`), in FAMILIES order."""
    from qwen_edit_core.families import FAMILIES
    return "\n\n".join(f.stage("sample_bench").run(real_size=real_size, device=device, steps=steps, repeats=repeats)
                       for f in FAMILIES.values())
