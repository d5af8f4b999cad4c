"""Edit Plus batches that mix 1, 2 and 3 control images (each of its own size): equal to one-by-one in loss
and gradients; the dataset accepts such pairs and the sampler can keep one control count per batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from qwen_edit_core import QwenImageEditTrainer
from qwen_edit_core.data.buckets import BucketBatchSampler
from qwen_edit_core.data.dataset import DatasetError, load_dataset

from conftest import train_config
from tolerances import TINY_FORWARD_ROUNDINGS, assert_close_fp32

SIZES = {1: [(64, 64)], 2: [(96, 64), (64, 96)], 3: [(64, 96), (96, 64), (64, 64)]}


def _mixed_count_pairs(folder):
    """Flat layout: pair cK has K controls, each control its own size; targets of different sizes too."""
    rng = np.random.default_rng(11)
    folder.mkdir(parents=True)
    targets = {1: (96, 64), 2: (64, 64), 3: (64, 96)}
    for k, sizes in SIZES.items():
        w, h = targets[k]
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / f"c{k}.png")
        for i, (cw, ch) in enumerate(sizes, start=1):
            Image.fromarray(rng.integers(0, 255, (ch, cw, 3), dtype=np.uint8)).save(folder / f"c{k}_control_{i}.png")
        (folder / f"c{k}.txt").write_text("combine " + "them " * k)
    return folder


def test_dataset_accepts_differing_control_counts(tmp_path):
    flat = _mixed_count_pairs(tmp_path / "flat")
    assert [len(e.controls) for e in load_dataset(flat).examples] == [1, 2, 3]
    folders = tmp_path / "folders"
    for sub in ("images", "control_1", "control_2"):
        (folders / sub).mkdir(parents=True)
    img = Image.new("RGB", (64, 64), (10, 20, 30))
    for name, dirs in (("one", ["control_1"]), ("two", ["control_1", "control_2"]), ("gap", ["control_2"])):
        img.save(folders / "images" / f"{name}.png")
        (folders / "images" / f"{name}.txt").write_text("x")
        for d in dirs:
            img.save(folders / d / f"{name}.png")
    with pytest.raises(DatasetError) as err:
        load_dataset(folders)
    assert len(err.value.problems) == 1 and "gap.png: has no control image named gap.png" in str(err.value)
    report = load_dataset(folders, skip_invalid=True)
    assert {e.name: len(e.controls) for e in report.examples} == {"one": 1, "two": 2}


def test_similar_count_grouping_keeps_one_control_count_per_batch():
    counts = [1, 2, 3, 1, 2, 3, 1, 2]
    sizes = [100, 100, 100, 200, 200, 200, 300, 300]
    keys = [((64, 64), ((64, 64),) * c) for c in counts]
    for epoch in range(3):
        batches = BucketBatchSampler(keys, 2, seed=0, sizes=sizes, groups=counts).epoch_batches(epoch)
        assert sorted(i for b in batches for i in b) == list(range(8))
        assert all(len({counts[i] for i in b}) == 1 for b in batches)
    mixed = BucketBatchSampler(keys, 3, seed=0, sizes=sizes).epoch_batches(0)
    assert any(len({counts[i] for i in b}) > 1 for b in mixed)


def test_mixed_control_counts_batch_equals_one_by_one_in_loss_and_gradients(tiny_plus_dir, tmp_path):
    from qwen_edit_core.adapters import lora, multires
    from qwen_edit_core.data.example_tensors import cache_key, encoder_identity
    from qwen_edit_core.train.batch import collate, flow_loss, sample_generator
    data = _mixed_count_pairs(tmp_path / "data")
    config = train_config(tiny_plus_dir, data, tmp_path / "o", data={"vae_area": 64 * 64, "vl_area": 64 * 64})
    trainer = QwenImageEditTrainer(config)
    examples = list(trainer.dataset().examples)
    trainer.cache(examples)
    settings = trainer.encode_settings("edit-plus")
    items = [trainer._cache().get(cache_key(e, settings, encoder_identity(tiny_plus_dir))) for e in examples]
    assert [len(i["img_shapes"]) - 1 for i in items] == [1, 2, 3]
    trainer.load_model(which=("transformer",))
    model, sched = trainer.components.transformer, trainer.components.scheduler_config
    torch.manual_seed(0)
    lora.inject_lora(model, lora.LoraSpec(rank=4, alpha=4.0, targets="all", init="gaussian"))
    with torch.no_grad():  # a non-zero B, so every LoRA parameter gets a gradient
        for layer in lora.adapter_layers(model).values():
            layer.lora_B["default"].weight.normal_(0, 0.02)
    multires.install(model)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    gens = lambda: [sample_generator(2, 0, 0, j) for j in range(3)]  # noqa: E731
    kw = dict(caption_dropout=0.0, control_dropout=0.0, device=torch.device("cpu"), dtype=torch.float32)
    loss, per_sample = flow_loss(model, collate(items, gens(), **kw), config, sched)
    loss.backward()
    grad = lambda p: p.grad.clone() if p.grad is not None else torch.zeros_like(p)  # noqa: E731 (unused layers)
    batch_grads = {n: grad(p) for n, p in params.items()}
    alone, grads = [], {n: torch.zeros_like(p) for n, p in params.items()}
    for item, gen in zip(items, gens()):
        model.zero_grad(set_to_none=True)
        single = flow_loss(model, collate([item], [gen], **kw), config, sched)[0]
        single.backward()
        alone.append(single.item())
        for n, p in params.items():
            grads[n] += grad(p) / 3
    # one call per layout instead of one per sample: other kernels' sums, a forward's roundings (doubled by the
    # squared error); the gradients: the backward (about twice the forward's) and the three samples' sum
    alone = torch.tensor(alone)
    assert_close_fp32(per_sample, alone, ops=2 * TINY_FORWARD_ROUNDINGS, what="per-sample losses batched vs alone")
    assert_close_fp32(loss, alone.mean(), ops=2 * TINY_FORWARD_ROUNDINGS + 3, what="batch loss vs alone")
    scale = max(g.abs().max().item() for g in grads.values())  # the gradients' size, over all of them
    assert scale > 0
    assert_close_fp32(batch_grads, grads, ops=2 * TINY_FORWARD_ROUNDINGS + 3, what="gradients batched vs alone",
                      size=scale)
