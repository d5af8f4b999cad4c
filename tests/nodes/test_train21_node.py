"""The Train node trains a Qwen-Image-2.1 LoRA from Dataset From Folder on the graph's loaded 2.1 model (pairs of
1 to 3 ordered references), inside ComfyUI's inference mode, and gives the graph's transformer back as it was."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file

import nodes
from qwen_edit_core.adapters import lora


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


def test_pairs_with_ordered_references_saved_in_the_graph_train_and_sample_through_the_lora(env, tiny_21_dir):
    """The shipped 2.1 training workflow's path: Save Pair To Dataset writes a pair whose controls are before,
    then a Reference Images chain; Train LoRA trains on its dataset output; Training Status gives the LoRA,
    which Load LoRA applies to the Sampler fed the same ordered references (the LoRA changes the picture)."""
    rng = torch.Generator().manual_seed(5)
    before, other, after = (torch.rand(1, 64, 64, 3, generator=rng) for _ in range(3))
    wide = torch.rand(1, 64, 96, 3, generator=rng)
    with torch.inference_mode():
        (model,) = nodes.QwenEditModelLoader().load("", "cpu", "cpu", "cpu", "float32", path=str(tiny_21_dir))
        (refs,) = nodes.QwenEditReferenceImages().collect(other)
        (refs,) = nodes.QwenEditReferenceImages().collect(wide, references=refs)
        data, _ = nodes.QwenEditSavePair().save(before, after, "put them together", str(env / "pairs"), "pair",
                                                references=refs)["result"]
        (example,) = data.report.examples
        assert [Image.open(p).size for p in example.controls] == [(64, 64), (64, 64), (96, 64)]
        (job,) = nodes.QwenEditTrainLoRA().start(model, data, "lora21_refs", 2, 1e-2, 4, "all", 1, 64, 0, False,
                                                 False)
        out = nodes.QwenEditTrainStatus().status(True, job=job)["result"]
        name, path = out[0], out[1]
        assert name == "lora21_refs.safetensors" and path
        args = ("put them together", " ", 2, 1.0, 0, 0, 0, "dynamic", "same", 64)
        plain = nodes.QwenEditSampler().sample(model, before, *args, references=refs)[0]
        (with_lora,) = nodes.QwenEditLoraLoader().apply(model, "(none)", 1.0, lora_path=path)
        trained = nodes.QwenEditSampler().sample(with_lora, before, *args, references=refs)[0]
    assert plain.shape == trained.shape == (1, 64, 64, 3)
    assert (trained - plain).abs().max() > 1e-3  # the LoRA reaches the sampled picture
