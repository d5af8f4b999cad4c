"""The training loop reads device values on the host (a GPU sync each) at most once per logging interval."""

from __future__ import annotations

import functools

import pytest

from conftest import train_config
from host_reads import HostReads
from qwen_edit_core import QwenImageEditTrainer
from qwen_edit_core.train import loop


def _counted(mode, counts, name, fn, count=True):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        before, mode.counting = mode.counting, count
        start = len(mode.where)
        try:
            return fn(*args, **kwargs)
        finally:
            mode.counting = before
            if count:
                counts.setdefault(name, []).append(mode.where[start:])
    return wrapper


real_make = loop.make_optimizer


@pytest.mark.parametrize("accumulation", [1, 2])
def test_training_reads_the_device_once_per_logging_interval(tiny_edit_dir, pairs_dir, tmp_path, monkeypatch,
                                                             accumulation):
    optimizers = []

    def optimizer_step_counter(tensor):
        # AdamW keeps its step count on the host (torch.optim: not `capturable`, not `fused`): reading it is free.
        return any(tensor is s.get("step") for opt in optimizers for s in opt.state.values())

    mode, counts = HostReads(host_side=optimizer_step_counter), {}
    mode.counting = False
    monkeypatch.setattr(loop, "make_optimizer", lambda *a, **k: optimizers.append(real_make(*a, **k)) or optimizers[-1])
    for name in ("micro_step", "optimizer_step", "after_step"):
        monkeypatch.setattr(loop, name, _counted(mode, counts, name, getattr(loop, name)))
    # Host-side data preparation (cache reads, dropout draws from CPU generators) is not device work.
    monkeypatch.setattr(loop, "collate", _counted(mode, counts, "collate", loop.collate, count=False))
    real_train = loop.train

    def train(config, transformer, load_item, *args, **kwargs):
        return real_train(config, transformer, _counted(mode, counts, "load_item", load_item, count=False), *args,
                          **kwargs)

    monkeypatch.setattr(loop, "train", train)
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path, logging={"every": 2}, train={
        "max_steps": 4, "gradient_accumulation_steps": accumulation, "mixed_precision": "bf16"})
    with mode:
        result = QwenImageEditTrainer(config).fit()
    assert result.step == 4 and [s for s, _ in result.history] == [2, 4]
    assert len(counts["micro_step"]) == 4 * accumulation
    assert all(reads == [] for reads in counts["micro_step"]), counts["micro_step"]
    assert all(reads == [] for reads in counts["optimizer_step"]), counts["optimizer_step"]
    assert [len(reads) for reads in counts["after_step"]] == [0, 1, 0, 1], counts["after_step"]
