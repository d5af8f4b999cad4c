"""A LoRA file names the model it was trained on without a path of the trainer's machine, and a file trained
for another model family is refused naming both families before it is applied."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qwen_edit_core import QwenImageEditTrainer
from qwen_edit_core.cli import main

from conftest import train_config


@pytest.fixture(scope="module")
def trained(tiny_edit_dir, pairs_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("identity") / "o"
    config = train_config(tiny_edit_dir, pairs_dir, out, train={"max_steps": 1},
                          model={"pretrained_model_name_or_path": str(tiny_edit_dir),
                                 "lora": {"rank": 4, "alpha": 4.0, "targets": "attn"}})
    return QwenImageEditTrainer(config).fit().lora_path


def _metadata(path) -> dict:
    with safe_open(str(path), "pt") as fh:
        return fh.metadata()


def test_the_lora_names_the_model_not_a_path_of_this_machine(trained, tiny_edit_dir):
    meta = _metadata(trained)
    assert meta["base_identity"] == f"edit:{tiny_edit_dir.name}"
    assert str(tiny_edit_dir.parent) not in json.dumps(meta)


def test_a_lora_of_another_family_is_refused_naming_both_before_loading(trained, tiny_edit_dir, pairs_dir, tmp_path,
                                                                        capsys, monkeypatch):
    other = tmp_path / "for21.safetensors"
    save_file(load_file(trained), other, metadata={**_metadata(trained), "architecture": "qwen-image-2.1"})
    import qwen_edit_core.api as api
    import qwen_edit_core.model.components as components
    monkeypatch.setattr(api, "load_components", lambda *a, **k: pytest.fail("weights loaded before the check"))
    monkeypatch.setattr(components, "load_components", lambda *a, **k: pytest.fail("weights loaded"))
    assert main(["sample", "--model", str(tiny_edit_dir), "--image", str(pairs_dir / "p0_control.png"),
                 "--prompt", "x", "--out", str(tmp_path / "o.png"), "--lora", str(other)]) == 2
    err = capsys.readouterr().err
    assert "the LoRA was trained for Qwen-Image-2.1 and this model is Qwen-Image (2025" in err, err
    assert str(other) in err and "Traceback" not in err
