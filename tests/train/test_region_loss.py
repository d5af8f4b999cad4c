"""Region-weighted loss: mixed-resolution batches with masks equal one-by-one, the weights' effect, and the
masked/unmasked losses validation reports."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from qwen_edit_core import QwenImageEditTrainer

from conftest import train_config
from tolerances import TINY_FORWARD_ROUNDINGS, assert_close_fp32


def _masked_mixed_pairs(folder):
    """Folder layout, three sizes, a mask on all but the last pair (box on the left third)."""
    rng = np.random.default_rng(7)
    for sub in ("images", "control", "masks"):
        (folder / sub).mkdir(parents=True)
    sizes = [(64, 64), (96, 64), (64, 96), (96, 64)]
    for i, (w, h) in enumerate(sizes):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / "images" / f"s{i}.png")
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / "control" / f"s{i}.png")
        (folder / "images" / f"s{i}.txt").write_text("make it " + "very " * i + "blue")
        if i < 3:
            mask = np.zeros((h, w), np.uint8)
            mask[:, : w // 3] = 255
            Image.fromarray(mask).save(folder / "masks" / f"s{i}.png")
    return folder


def _items(trainer, examples):
    from qwen_edit_core.data.example_tensors import cache_key, encoder_identity
    trainer.cache(examples)
    settings = trainer.encode_settings("edit")
    from pathlib import Path
    identity = encoder_identity(Path(trainer.config.model.pretrained_model_name_or_path))
    return [trainer._cache().get(cache_key(e, settings, identity)) for e in examples]


@pytest.fixture(scope="module")
def masked_setup(tiny_edit_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("masked")
    data = _masked_mixed_pairs(tmp / "data")
    config = train_config(tiny_edit_dir, data, tmp / "o", data={"vae_area": 80 * 80},
                          train={"mask_weight": 3.0, "unmasked_weight": 0.5})
    trainer = QwenImageEditTrainer(config)
    examples = sorted(trainer.dataset().examples, key=lambda e: e.name)
    items = _items(trainer, examples)
    trainer.load_model(which=("transformer",))
    from qwen_edit_core.adapters import multires
    multires.install(trainer.components.transformer)
    return trainer, items, data


def _gens(n):
    from qwen_edit_core.train.batch import sample_generator
    return [sample_generator(1, 0, 0, j) for j in range(n)]


KW = dict(caption_dropout=0.0, control_dropout=0.0, device=torch.device("cpu"), dtype=torch.float32)


def test_mixed_resolution_batch_with_masks_equals_one_by_one(masked_setup):
    from qwen_edit_core.train.batch import collate, flow_loss
    trainer, items, _ = masked_setup
    assert len({tuple(map(tuple, i["img_shapes"].tolist())) for i in items[:3]}) == 3
    assert ["loss_mask" in i for i in items] == [True, True, True, False]
    model, sched, config = trainer.components.transformer, trainer.components.scheduler_config, trainer.config
    with torch.no_grad():
        loss, per_sample = flow_loss(model, collate(items, _gens(4), **KW), config, sched)
        alone = [flow_loss(model, collate([item], [g], **KW), config, sched)[0] for item, g in zip(items, _gens(4))]
    # one call per layout instead of one per sample: other kernels' sums, a forward's roundings (doubled by the
    # squared error)
    alone = torch.stack(alone)
    assert_close_fp32(per_sample, alone, ops=2 * TINY_FORWARD_ROUNDINGS, what="per-sample losses batched vs alone")
    assert_close_fp32(loss, alone.mean(), ops=2 * TINY_FORWARD_ROUNDINGS + 4, what="batch loss vs alone")


def test_weights_scale_the_masked_and_unmasked_errors(masked_setup):
    """loss = mean over tokens of (0.5 + 2.5 m) * err = (0.5 * sum err + 2.5 * sum m err) / N, with sum m err and
    sum (1 - m) err recovered from the region losses; and weights 1/1 give the plain loss."""
    import dataclasses
    from qwen_edit_core.train.batch import collate, flow_loss, region_losses
    trainer, items, _ = masked_setup
    model, sched, config = trainer.components.transformer, trainer.components.scheduler_config, trainer.config
    item = items[1]
    m = item["loss_mask"].double()
    with torch.no_grad():
        weighted = flow_loss(model, collate([item], _gens(1), **KW), config, sched)[0].item()
        masked, unmasked = region_losses(model, collate([item], _gens(1), **KW), config, sched)
        plain_cfg = dataclasses.replace(config, train=dataclasses.replace(config.train, mask_weight=1.0,
                                                                          unmasked_weight=1.0))
        plain = flow_loss(model, collate([item], _gens(1), **KW), plain_cfg, sched)[0].item()
    inside, outside = masked * m.sum().item(), unmasked * (1 - m).sum().item()
    n = m.numel()
    assert 0 < m.mean() < 1
    # float32 means over the 64 channels and the n tokens, each summed in another order
    ops = 64 + n
    assert_close_fp32(plain, (inside + outside) / n, ops=ops, what="unweighted loss vs its two regions")
    assert_close_fp32(weighted, (0.5 * (inside + outside) + 2.5 * inside) / n, ops=ops, what="weighted loss")


def test_validation_reports_masked_and_unmasked_loss(tiny_edit_dir, masked_setup, tmp_path):
    _, _, data = masked_setup
    out = tmp_path / "o"
    config = train_config(tiny_edit_dir, data, out, cache={"dir": str(tmp_path / "cache")},
                          data={"vae_area": 80 * 80, "batch_size": 1},
                          train={"max_steps": 4, "validation_every": 2})
    result = QwenImageEditTrainer(config).fit()
    assert [s for s, _, _ in result.region_losses] == [2, 4]
    assert all(np.isfinite(v) and v > 0 for _, a, b in result.region_losses for v in (a, b))
    rows = (out / "validation" / "region_loss.csv").read_text().strip().splitlines()
    assert rows[0] == "step,masked_loss,unmasked_loss" and [r.split(",")[0] for r in rows[1:]] == ["2", "4"]
