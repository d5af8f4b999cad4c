"""The Train node trains a Qwen-Image-2.1 LoRA from Dataset From Folder on the graph's loaded 2.1 model (pairs of
1 to 3 ordered references), inside ComfyUI's inference mode, and gives the graph's transformer back as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import nodes
from qwen_edit_core.adapters import lora


@pytest.fixture
def env(tmp_path, monkeypatch):
    for name in ("QWEN_EDIT_HOME", "QWEN_EDIT_LORAS", "QWEN_EDIT_OUTPUT"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_train_node_trains_a_21_lora_on_the_graphs_model(env, tiny_21_dir):
    folder = env / "pairs21"
    folder.mkdir()
    rng = np.random.default_rng(3)
    for k in (1, 2, 3):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(folder / f"p{k}.png")
        for i in range(1, k + 1):
            Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)).save(folder / f"p{k}_control_{i}.png")
        (folder / f"p{k}.txt").write_text("combine them")
    with torch.inference_mode():
        (model,) = nodes.QwenEditModelLoader().load("", "cpu", "cpu", "cpu", "float32", path=str(tiny_21_dir))
        data, _ = nodes.QwenEditDataset().load(str(folder), False)["result"]
        transformer = model.components.transformer
        before = {n: p.detach().clone() for n, p in transformer.named_parameters()}
        (job,) = nodes.QwenEditTrain().start(model, data, "lora21", 2, 1e-3, 4, 4.0, "all", 1, 64, 0, False, 0,
                                             False)
    status = job.wait()
    assert status.state == "done", status.error
    path = status.lora_path
    keys = load_file(path)
    assert any(k.startswith("transformer_blocks.0.img_mlp.gate_layer.") for k in keys)
    assert set(lora.read_lora_file(path).layers) == set(lora.adaptable_modules(transformer)) - {
        n for n in lora.adaptable_modules(transformer) if not n.startswith("transformer_blocks.")}
    after = dict(transformer.named_parameters())
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
