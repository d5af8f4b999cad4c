"""Fresh nodes fit the model they are given: the Sampler's CFG and Train's steps and learning rate default to
"auto", which is the built-in toy's values on the toy (the default model: CFG 1, the demo's 250 steps at 1e-2)
and a real model's otherwise (CFG 4 for Qwen-Image-Edit, 1 for the CFG-distilled Qwen-Image-2.1; 1000 steps at
1e-4); a value a saved workflow holds is used as it is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nodes
from nodes.common import (AUTO_CFG, TINY_21_MODEL, TINY_MODEL, TOY_MODEL, DatasetHandle, ModelHandle, resolve_model,
                          training_defaults)
from nodes.sample_nodes import cfg_of
from qwen_edit_core import jobs
from qwen_edit_core.model.components import Components
from qwen_edit_core.train.loop import TrainResult


def _handle(name: str, variant: str) -> ModelHandle:
    return ModelHandle(Components(model_dir=resolve_model(name), variant=variant, scheduler_config={}))


def test_fresh_sampler_and_train_nodes_default_to_auto():
    for node in (nodes.QwenEditSampler, nodes.QwenEditSampleConditioning):
        assert node.INPUT_TYPES()["required"]["true_cfg_scale"][1]["default"] == AUTO_CFG < 0, node.__name__
    for node in (nodes.QwenEditTrainLoRA, nodes.QwenEditTrain):
        spec = node.INPUT_TYPES()["required"]
        assert spec["steps"][1]["default"] == 0 and spec["learning_rate"][1]["default"] == 0, node.__name__
        assert spec["steps"][1]["min"] == 0 and spec["learning_rate"][1]["min"] == 0, node.__name__


def test_auto_is_the_toys_values_on_the_toy_and_a_real_models_otherwise(tmp_path, monkeypatch):
    monkeypatch.setenv("QWEN_EDIT_HOME", str(tmp_path))
    toy, tiny, tiny21 = _handle(TOY_MODEL, "edit"), _handle(TINY_MODEL, "edit"), _handle(TINY_21_MODEL, "image-2.1")
    assert cfg_of(AUTO_CFG, toy) == 1.0  # the toy learned its edits without CFG
    assert cfg_of(AUTO_CFG, tiny) == 4.0 and cfg_of(AUTO_CFG, tiny21) == 1.0  # the families' pipelines
    assert cfg_of(AUTO_CFG, tiny, schedule="lightning") == 1.0  # a schedule's own scale comes first
    assert cfg_of(AUTO_CFG, tiny, sigmas="qwen21-turbo-8step") == 1.0  # and a sigma preset's
    assert cfg_of(3.5, toy) == 3.5 and cfg_of(0.0, tiny) == 0.0  # stored values stay
    assert training_defaults(toy) == (250, 1e-2) and training_defaults(tiny) == (1000, 1e-4)


class Recorded:
    """A fake run: records the config it was given and leaves a LoRA at once."""

    def __init__(self):
        self.configs = []

    def __call__(self, config, *, resume, progress, cancel, lock=None, model=None):
        self.configs.append(config)
        out = Path(config.train.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        lora = out / f"{config.train.lora_name}.safetensors"
        lora.write_text("trained")
        return TrainResult(state="done", step=config.train.max_steps, lora_path=lora, loss_plot=None)


@pytest.mark.parametrize("stored, expected", [((0, 0.0), (1000, 1e-4)), ((7, 3e-5), (7, 3e-5))])
def test_train_node_resolves_auto_from_the_model_and_keeps_stored_values(stored, expected, tmp_path, monkeypatch):
    for name in ("QWEN_EDIT_HOME", "QWEN_EDIT_OUTPUT"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    run = Recorded()
    monkeypatch.setattr(jobs, "REGISTRY", jobs.JobRegistry(fit=run, preflight=lambda config, resume: None))
    with torch.inference_mode():
        (model,) = nodes.QwenEditModelLoader().load(TINY_MODEL, "cpu", "cpu", "cpu", "float32")
        (data, _) = nodes.QwenEditSyntheticDataset().make(str(tmp_path / "pairs"), 2, 0)
        (job,) = nodes.QwenEditTrainLoRA().start(model, data, "auto_lora", *stored, 4, "attn", 1, 64, 0, False,
                                                 False)
    assert job.wait(60).state == "done"
    (config,) = run.configs
    assert (config.train.max_steps, config.optimizer.lr) == expected
    assert config.predict.true_cfg_scale == 4.0  # validation previews sample at the model's CFG


def test_validation_previews_on_the_toy_sample_at_cfg_1(tmp_path, monkeypatch):
    from nodes.train_nodes import _config
    from qwen_edit_core.train.validation import previews_from_config
    monkeypatch.setenv("QWEN_EDIT_HOME", str(tmp_path))
    toy = _handle(TOY_MODEL, "edit")
    toy = ModelHandle(Components(model_dir=toy.components.model_dir, variant="edit", scheduler_config={},
                                 transformer=torch.nn.Linear(2, 2)))
    data = DatasetHandle(tmp_path, report=None)
    (preview,) = previews_from_config(_config(toy, data, output_dir=tmp_path / "run", resolution=0))
    assert preview.settings.true_cfg_scale == 1.0 and preview.label.endswith("CFG 1"), preview.label
