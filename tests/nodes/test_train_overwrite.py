"""A second run under a LoRA name that was trained before: refused in the Train node's words (resume, another
lora_name, or its `overwrite` input), and with `overwrite` on the old run is moved aside and training starts anew
(the core's --overwrite: train/run_folder.py), here with a fake run inside the fake runtime."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nodes
from nodes.common import TINY_MODEL
from qwen_edit_core import jobs
from qwen_edit_core.train import run_folder
from qwen_edit_core.train.loop import TrainResult


class Claiming:
    """A fake run that takes its output folder as the trainer does (run_folder.claim: the old run moved aside
    with `overwrite`) and leaves a LoRA saying how many steps it trained."""

    def __call__(self, config, *, resume, progress, cancel, lock=None, model=None, overwrite=False):
        out = Path(config.train.output_dir)
        run_folder.claim(out, None, overwrite)
        lora = out / f"{config.train.lora_name}.safetensors"
        lora.write_text(f"{config.train.max_steps} steps")
        return TrainResult(state="done", step=config.train.max_steps, lora_path=lora, loss_plot=None)


def _check(config, resume, overwrite=False):
    """The trainer's preflight as far as the run folder goes (api.check_fit_inputs)."""
    run_folder.check_free(Path(config.train.output_dir), None, overwrite)


@pytest.fixture
def train(tmp_path, monkeypatch):
    """start(steps, overwrite) -> the finished job of Train LoRA named "again" on the tiny model."""
    for name in ("QWEN_EDIT_HOME", "QWEN_EDIT_OUTPUT"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setattr(jobs, "REGISTRY", jobs.JobRegistry(fit=Claiming(), preflight=_check))
    with torch.inference_mode():
        (model,) = nodes.QwenEditModelLoader().load(TINY_MODEL, "cpu", "cpu", "cpu", "float32")
        (data, _) = nodes.QwenEditSyntheticDataset().make(str(tmp_path / "pairs"), 2, 0)

    def start(steps, **overwrite):
        with torch.inference_mode():
            (job,) = nodes.QwenEditTrainLoRA().start(model, data, "again", steps, 1e-3, 4, "attn", 1, 64, 0, False,
                                                     False, **overwrite)
        assert job.wait(60).state == "done", job.status()
        return job

    return start


def test_overwrite_is_the_train_nodes_last_input_but_for_those_added_after_it():
    for node, after in ((nodes.QwenEditTrainLoRA, []), (nodes.QwenEditTrain, ["cpu_threads"])):
        names = list(node.INPUT_TYPES()["optional"])
        options = node.INPUT_TYPES()["optional"]["overwrite"]
        assert names[names.index("overwrite") + 1:] == after, node.__name__
        assert options[0] == "BOOLEAN" and options[1]["default"] is False, node.__name__


def test_a_second_run_is_refused_naming_the_inputs_and_overwrite_moves_the_old_run_aside(train, tmp_path):
    first = train(3)
    out = first.output_dir
    with pytest.raises(run_folder.OutputDirTakenError) as refused:
        train(5)  # another run under the same name, overwrite off
    words = str(refused.value)
    assert "overwrite" in words and "resume" in words and "lora_name" in words and "again.safetensors" in words
    assert "--" not in words, f"command-line words in a node's message: {words}"
    assert (out / "again.safetensors").read_text() == "3 steps"  # nothing was touched

    second = train(5, overwrite=True)
    assert second is not first and (out / "again.safetensors").read_text() == "5 steps"
    (aside,) = out.parent.glob("again.replaced-*")
    assert (aside / "again.safetensors").read_text() == "3 steps"

    third = train(5, overwrite=True)  # the same settings again: a finished run is redone, not attached to
    assert third is not second and len(list(out.parent.glob("again.replaced-*"))) == 2
