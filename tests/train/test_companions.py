"""Training on top of frozen companion LoRAs (model.lora.stack) and validation previews with several schedules."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from qwen_edit_core import QwenImageEditTrainer
from qwen_edit_core.adapters import lora
from qwen_edit_core.common.progress import CancelToken
from qwen_edit_core.model.components import load_transformer

from conftest import train_config


@pytest.fixture(scope="module")
def companion(tiny_edit_dir, tmp_path_factory):
    """A LoRA file on every linear (attention and MLPs), rank 2, random B: another LoRA to train on top of."""
    path = tmp_path_factory.mktemp("companion") / "companion.safetensors"
    model = load_transformer(tiny_edit_dir, device=torch.device("cpu"), dtype=torch.float32)
    spec = lora.LoraSpec(rank=2, alpha=2.0, targets=lora.resolve_targets("all"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(9)
        lora.inject_lora(model, spec)
        with torch.no_grad():
            for layer in lora.adapter_layers(model).values():
                layer.lora_B["default"].weight.normal_(0, 0.2)
    return lora.save_lora(path, model, spec, base_identity="tiny", steps=1)


def _config(tiny_edit_dir, pairs_dir, out, stack=(), cached=True, **train):
    return train_config(tiny_edit_dir, pairs_dir, out, cache_dir=out.parent / "cache", cache={"enabled": cached},
                        model={"pretrained_model_name_or_path": str(tiny_edit_dir),
                               "lora": {"rank": 4, "alpha": 4.0, "targets": "attn", "stack": list(stack)}},
                        train={"max_steps": 2, "seed": 3, **train})


@pytest.fixture(scope="module")
def plain(tiny_edit_dir, pairs_dir, tmp_path_factory):
    """The LoRA trained without companions (the baseline of every comparison here)."""
    out = tmp_path_factory.mktemp("plain") / "o"
    return load_file(QwenImageEditTrainer(_config(tiny_edit_dir, pairs_dir, out)).fit().lora_path)


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_companion_is_frozen_active_and_not_saved(tiny_edit_dir, pairs_dir, tmp_path, companion, plain):
    before = load_file(companion)
    trainer = QwenImageEditTrainer(_config(tiny_edit_dir, pairs_dir, tmp_path / "o",
                                           stack=[{"path": str(companion), "strength": 0.8}]))
    saved = load_file(trainer.fit().lora_path)
    # only the trained LoRA: its keys (attention only, no companion MLP keys) and its rank-4 matrices
    assert saved.keys() == plain.keys()
    assert not any("mlp" in k for k in saved)
    assert all(v.shape[0] == 4 for k, v in saved.items() if k.endswith("lora_down.weight"))
    # the companion was active (the trained values differ) and stayed frozen (its file and adapter unchanged)
    assert _max_diff(saved, plain) > 1e-5
    transformer = trainer.components.transformer
    name = lora.file_adapter_name(companion)
    for module, layer in lora.adapter_layers(transformer, name).items():
        assert torch.equal(layer.lora_B[name].weight, before[f"diffusion_model.{module}.lora_up.weight"])
    assert _max_diff(load_file(companion), before) == 0


def test_zero_strength_companion_equals_training_without(tiny_edit_dir, pairs_dir, tmp_path, companion, plain):
    trained = QwenImageEditTrainer(_config(tiny_edit_dir, pairs_dir, tmp_path / "o",
                                           stack=[{"path": str(companion), "strength": 0.0}])).fit()
    assert _max_diff(load_file(trained.lora_path), plain) == 0


def test_resume_restores_the_stack(tiny_edit_dir, pairs_dir, tmp_path, companion):
    stack = [{"path": str(companion), "strength": 0.8}]
    full = QwenImageEditTrainer(_config(tiny_edit_dir, pairs_dir, tmp_path / "full", stack=stack,
                                        max_steps=3)).fit()
    token = CancelToken()

    def stop_at_1(event):
        if event.stage == "train" and event.step == 1:
            token.cancel()

    out = tmp_path / "stopped"
    stopped = QwenImageEditTrainer(_config(tiny_edit_dir, pairs_dir, out, stack=stack, max_steps=3,
                                           checkpoint_every=1)).fit(progress=stop_at_1, cancel=token)
    assert stopped.state == "cancelled"
    # resumed with no stack configured: the checkpoint's stack comes back
    resumed = QwenImageEditTrainer(_config(tiny_edit_dir, pairs_dir, out, max_steps=3)).fit(resume=True)
    assert _max_diff(load_file(resumed.lora_path), load_file(full.lora_path)) == 0  # the same steps, bit for bit
    other = [{"path": str(companion), "strength": 0.5}]
    with pytest.raises(ValueError, match="model.lora.stack"):
        QwenImageEditTrainer(_config(tiny_edit_dir, pairs_dir, out, stack=other, max_steps=3)).fit(resume=True)


@pytest.mark.parametrize("cached", [True, False])
def test_validation_previews_side_by_side(tiny_edit_dir, pairs_dir, tmp_path, companion, plain, cached):
    previews = [{"schedule": "diffusers", "steps": 2},
                {"schedule": "lightning", "loras": [{"path": str(companion), "strength": 1.0}], "label": "fast"}]
    config = _config(tiny_edit_dir, pairs_dir, tmp_path / "o", cached=cached, validation_every=1,
                     validation_previews=previews, validation_image=str(pairs_dir / "p0_control.png"),
                     validation_prompt="invert the colors")
    result = QwenImageEditTrainer(config).fit()
    assert [p.name for p in result.validation_images] == ["step-0000001.png", "step-0000002.png"]
    png = result.validation_images[-1]
    latents = png.with_suffix(".safetensors")
    with safe_open(latents, "pt") as f:
        assert json.loads(f.metadata()["labels"]) == ["diffusers 2 steps, CFG 4", "fast"]
    data = load_file(latents)
    width, height = data["size"].tolist()
    assert Image.open(png).size[0] == 2 * width and Image.open(png).size[1] > height
    assert (data["latents_0"] - data["latents_1"]).abs().max() > 1e-3
    # the preview's LoRA was active for that preview only: training is the same as without validation
    assert _max_diff(load_file(result.lora_path), plain) == 0
    pixels = np.asarray(Image.open(png))
    assert pixels[:10].min() < 128  # the label band holds dark text
