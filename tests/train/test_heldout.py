"""Held-out validation pairs: kept out of training, sampled at each validation step, their errors to their
targets in validation/metrics.csv (equal to a computation from the written pictures and latents) and plot."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.torch import load_file

from qwen_edit_core import QwenImageEditTrainer
from qwen_edit_core.train import loop

from conftest import train_config

#: metrics.csv prints 8 significant digits: a value read back is within half a unit of the 8th (5e-8 of it) of
#: the one computed, which the test recomputes from the same pictures and latents (float64 means, and the same
#: float32 latent sums); one unit of the 8th digit covers both
CSV_REL = 1e-7


def _pairs(folder, n=5):
    """Flat layout, 64x64, random pictures; the last pair has a mask (its left half edited)."""
    rng = np.random.default_rng(11)
    folder.mkdir(parents=True)
    for i in range(n):
        for suffix in ("", "_control"):
            Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(folder / f"p{i}{suffix}.png")
        (folder / f"p{i}.txt").write_text("invert the colours")
    mask = np.zeros((64, 64), np.uint8)
    mask[:, :32] = 255
    Image.fromarray(mask).save(folder / f"p{n - 1}_mask.png")
    return folder


@pytest.fixture(scope="module")
def heldout_run(tiny_edit_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("heldout")
    data = _pairs(tmp / "data")
    config = train_config(tiny_edit_dir, data, tmp / "o", train={
        "max_steps": 4, "validation_every": 2, "validation_pairs": 2, "validation_steps": 2})
    trained_on, loaded = [], []
    real_train = loop.train

    def spy(config, transformer, load_item, examples, *args, **kwargs):
        trained_on.extend(e.name for e in examples)
        return real_train(config, transformer, lambda i: loaded.append(examples[i].name) or load_item(i),
                          examples, *args, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "train", spy)
        trainer = QwenImageEditTrainer(config)
        result = trainer.fit()
    return trainer, result, data, tmp / "o", trained_on, loaded


def test_heldout_pairs_are_never_trained_on(heldout_run):
    _, result, _, _, trained_on, loaded = heldout_run
    assert result.state == "done" and sorted(trained_on) == ["p0", "p1", "p2"]
    assert loaded and set(loaded) <= {"p0", "p1", "p2"}


def _rows(out):
    with open(out / "validation" / "metrics.csv", newline="") as fh:
        reader = csv.DictReader(fh)
        return reader.fieldnames, list(reader)


def test_metrics_csv_has_a_row_per_validation_step(heldout_run):
    _, result, _, out, _, _ = heldout_run
    columns, rows = _rows(out)
    assert columns == ["step", "latent_mse", "pixel_mse", "pixel_mse_in_mask", "pixel_mse_out_mask"]
    assert [int(r["step"]) for r in rows] == [2, 4]
    assert [r[0] for r in result.validation_metrics] == [2, 4]
    assert (out / "validation" / "metrics.png").is_file()


def test_metrics_equal_a_computation_from_the_written_pictures(heldout_run):
    """Pixel errors from the PNGs and the targets resized (bicubic) to the sampled size; the latent error from the
    written latents and the cache's target latents; region errors from the one masked pair."""
    from qwen_edit_core.data.example_tensors import cache_key, encoder_identity
    from qwen_edit_core.families.qwen_image import encode
    trainer, _, data, out, _, _ = heldout_run
    examples = {e.name: e for e in trainer.dataset().examples}
    identity = encoder_identity(Path(trainer.config.model.pretrained_model_name_or_path))
    settings = trainer.encode_settings("edit")
    for row in _rows(out)[1]:
        folder = out / "validation" / "heldout" / f"step-{int(row['step']):07d}"
        latent, pixel, regions = [], [], None
        for name in ("p3", "p4"):
            picture = np.asarray(Image.open(folder / f"{name}.png").convert("RGB"), dtype=np.float64) / 255
            h, w = picture.shape[:2]
            target = np.asarray(Image.open(data / f"{name}.png").convert("RGB").resize((w, h), Image.BICUBIC),
                                dtype=np.float64) / 255
            err = ((picture - target) ** 2).mean(axis=-1)
            pixel.append(err.mean())
            if name == "p4":
                inside = np.asarray(Image.open(data / "p4_mask.png").resize((w, h), Image.BILINEAR)) >= 128
                regions = err[inside].mean(), err[~inside].mean()
            cached = trainer._cache().get(cache_key(examples[name], settings, identity))
            sampled = load_file(folder / f"{name}.safetensors")["latents"]
            latent.append(((sampled - encode.pack(cached["target_latents"][None]).float()) ** 2).mean().item())
        assert float(row["pixel_mse"]) == pytest.approx(np.mean(pixel), rel=CSV_REL)
        assert float(row["latent_mse"]) == pytest.approx(np.mean(latent), rel=CSV_REL)
        assert float(row["pixel_mse_in_mask"]) == pytest.approx(regions[0], rel=CSV_REL)
        assert float(row["pixel_mse_out_mask"]) == pytest.approx(regions[1], rel=CSV_REL)
        assert 0 < regions[0] != regions[1]


def test_validation_pairs_must_leave_pairs_to_train_on(tiny_edit_dir, tmp_path):
    from qwen_edit_core.train.heldout import split_heldout
    data = _pairs(tmp_path / "d", n=2)
    examples = QwenImageEditTrainer(train_config(tiny_edit_dir, data, tmp_path / "o")).dataset().examples
    with pytest.raises(ValueError, match="train.validation_pairs 2 .* 2 pairs"):
        split_heldout(examples, 2, None)
    with pytest.raises(ValueError, match="also in data.folder"):
        split_heldout(examples, str(data), lambda folder: examples)
    config = train_config(tiny_edit_dir, data, tmp_path / "o", train={"validation_pairs": 1})
    with pytest.raises(ValueError, match="needs train.validation_every"):
        QwenImageEditTrainer(config).fit()

