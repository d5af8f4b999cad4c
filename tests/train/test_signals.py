"""Exact resume whatever the signals: a checkpoint holds a step boundary's state, also when a second signal
stops the run during validation or inside an optimizer step."""

from __future__ import annotations

import signal

import pytest
import torch
from safetensors.torch import load_file

from qwen_edit_core import QwenImageEditTrainer
from qwen_edit_core.common.progress import CancelToken, Interrupted, SignalStop
from qwen_edit_core.train.checkpoint import list_checkpoints

from conftest import train_config


def _config(tiny_edit_dir, pairs_dir, out, cache):
    return train_config(tiny_edit_dir, pairs_dir, out, cache,
                        train={"max_steps": 4, "validation_every": 2, "validation_steps": 1,
                               "validation_image": str(pairs_dir / "p0_control.png"), "validation_prompt": "x"})


def _equal(a, b) -> bool:
    a, b = load_file(a), load_file(b)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_signals_during_validation_save_the_boundary_and_resume_exactly(tiny_edit_dir, pairs_dir, tmp_path,
                                                                             monkeypatch):
    from qwen_edit_core.train import validation
    real = validation.Validator.__call__

    def validate_then_two_signals(self, step, write=True):
        written = real(self, step, write)
        if step == 2:  # the first asks for a stop at the next boundary, the second stops at once
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGTERM)
        return written
    monkeypatch.setattr(validation.Validator, "__call__", validate_then_two_signals)
    out, cache = tmp_path / "o", tmp_path / "cache"
    cancel = CancelToken()
    with SignalStop(cancel) as stop:
        result = QwenImageEditTrainer(_config(tiny_edit_dir, pairs_dir, out, cache)).fit(
            progress=stop.progress(), cancel=cancel)
    assert result.state == "cancelled" and result.step == 2 and stop.received == signal.SIGTERM
    assert [c.step for c in list_checkpoints(out / "checkpoints")] == [2]
    monkeypatch.undo()
    resumed = QwenImageEditTrainer(_config(tiny_edit_dir, pairs_dir, out, cache)).fit(resume=True)
    full = QwenImageEditTrainer(_config(tiny_edit_dir, pairs_dir, tmp_path / "full", cache)).fit()
    assert resumed.step == full.step == 4 and _equal(resumed.lora_path, full.lora_path)


def test_a_signal_inside_a_shielded_block_is_raised_when_it_ends():
    token, done = CancelToken(), []
    with pytest.raises(Interrupted):
        with SignalStop(token) as stop:
            stop.training = True
            signal.raise_signal(signal.SIGINT)  # first: a cancel at the next boundary
            assert token.cancelled
            with token.shielded():
                signal.raise_signal(signal.SIGINT)  # second, inside the block: held
                done.append("the block ran to its end")
    assert done == ["the block ran to its end"]
