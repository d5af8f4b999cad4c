"""Save Pair To Dataset: stock IMAGE pairs and a stock MASK (ComfyUI's convention: float (B, H, W) in [0, 1],
1 = the masked, i.e. edited, region) become a dataset folder that loads, and the mask reaches the training
loss weights as the dataset's own mask reader computes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import nodes
from qwen_edit_core import QwenImageEditTrainer
from qwen_edit_core.data import masks
from qwen_edit_core.data.dataset import load_dataset

from conftest import train_config
from tolerances import fp32_tolerance, max_abs_diff

H, W = 64, 96


def _images(n=1, seed=0, h=H, w=W):
    return torch.rand(n, h, w, 3, generator=torch.Generator().manual_seed(seed))


def _load_image_mask(h=H, w=W):
    """The MASK stock Load Image returns for an RGBA picture (ComfyUI nodes.py LoadImage: 1 - alpha / 255): the
    region painted in the mask editor (made transparent) is 1. Here a soft-edged box, so area averaging shows."""
    alpha = np.full((h, w), 255, np.uint8)
    alpha[8:40, 20:70] = 0
    alpha[8:40, 70:76] = 128  # a half-painted edge
    return 1.0 - torch.from_numpy(alpha.astype(np.float32) / 255.0)[None]


def test_saved_pair_loads_and_its_mask_reaches_the_loss_weights(tiny_edit_dir, tmp_path):
    from qwen_edit_core.data.example_tensors import cache_key, encoder_identity
    from qwen_edit_core.train.batch import collate, region_weights, sample_generator
    mask = _load_image_mask()
    folder = tmp_path / "masked"
    out = nodes.QwenEditSavePair().save(_images(seed=1), _images(seed=2), "invert the colors", str(folder), "pair",
                                        mask=mask)
    handle, summary = out["result"]
    assert summary.startswith("wrote pair_00001 (1 with a mask)") and "the folder has 1 pair, 1 with" in summary
    assert handle.folder == folder
    (example,) = load_dataset(folder).examples
    assert example.mask == folder / "pair_00001_mask.png" and example.caption == "invert the colors"
    # painted (MASK 1) is written white (edited); the rest black
    written = np.asarray(Image.open(example.mask))
    assert written[20, 30] == 255 and written[0, 0] == 0 and written[20, 72] == 127

    config = train_config(tiny_edit_dir, folder, tmp_path / "o", data={"vae_area": H * W},
                          train={"mask_weight": 3.0, "unmasked_weight": 0.5})
    trainer = QwenImageEditTrainer(config)
    trainer.cache([example])
    item = trainer._cache().get(cache_key(example, trainer.encode_settings("edit"),
                                          encoder_identity(tiny_edit_dir)))
    _, grid_h, grid_w = item["img_shapes"][0].tolist()
    batch = collate([item], [sample_generator(1, 0, 0, 0)], caption_dropout=0.0, control_dropout=0.0,
                    device=torch.device("cpu"), dtype=torch.float32)
    weights = region_weights(batch, grid_h * grid_w, 3.0, 0.5, "cpu")[0]
    # the dataset's own reader of the written file, and the MASK input itself, area-averaged on the token grid
    from_file = masks.token_weights(masks.mask_tokens(example.mask, grid_w * 16, grid_h * 16), 3.0, 0.5)
    from_input = 0.5 + 2.5 * F.interpolate(mask[None], size=(grid_h, grid_w), mode="area").reshape(-1)
    assert torch.equal(weights, from_file)
    # 8-bit PNG rounding only (half a level, 1/510, times the weights' span 2.5), and the float32 rounding of the
    # area means (16 x 16 pixels a token) and of the scale and offset
    allowed = 2.5 / 510 + fp32_tolerance(from_input, ops=16 * 16 + 2)
    assert max_abs_diff(weights, from_input) <= allowed
    assert weights.max() == pytest.approx(3.0) and weights.min() == pytest.approx(0.5)


def test_batches_numbering_and_a_mask_for_the_whole_batch(tmp_path):
    folder = tmp_path / "batch"
    mask2d = _load_image_mask()[0]  # some nodes give (H, W): one mask for the batch
    out = nodes.QwenEditSavePair().save(_images(3, seed=1), _images(3, seed=2), "x", str(folder), "img", mask=mask2d,
                                        before_2=_images(1, seed=3))
    assert out["result"][1].startswith("wrote img_00001, img_00002, img_00003 (3 with a mask)")
    report = load_dataset(folder)
    assert [len(e.controls) for e in report.examples] == [2, 2, 2] and all(e.mask for e in report.examples)
    again = nodes.QwenEditSavePair().save(_images(seed=4), _images(seed=5), "x", str(folder), "img")
    assert again["result"][1].startswith("wrote img_00004 (0 with a mask)") and "has 4 pairs, 3 with a mask" in \
        again["result"][1]


def test_save_pair_errors_are_clear(tmp_path):
    folder = tmp_path / "bad"
    node = nodes.QwenEditSavePair()
    empty_load_image_mask = torch.zeros(1, 64, 64)  # Load Image's mask of a picture without transparency
    with pytest.raises(ValueError, match="mask is 64x64 but the target \\(after\\) image is 96x64.*Load Image"):
        node.save(_images(), _images(), "x", str(folder), "pair", mask=empty_load_image_mask)
    with pytest.raises(ValueError, match="mask is empty"):
        node.save(_images(), _images(), "x", str(folder), "pair", mask=torch.zeros(1, H, W))
    with pytest.raises(ValueError, match="mask has a batch of 2 but 'after' has 3"):
        node.save(_images(3), _images(3), "x", str(folder), "pair", mask=torch.ones(2, H, W))
    with pytest.raises(ValueError, match="target \\(after\\) image is 48x32, too small"):
        node.save(_images(), _images(h=32, w=48), "x", str(folder), "pair")
    with pytest.raises(ValueError, match="caption is empty"):
        node.save(_images(), _images(), " ", str(folder), "pair")
    assert not folder.exists()


def _saved_controls(folder) -> list:
    (example,) = load_dataset(folder).examples
    return [np.asarray(Image.open(path)) for path in example.controls]


def _pixels(image_row) -> np.ndarray:
    return (image_row.numpy() * 255).round().astype(np.uint8)


def test_ten_ordered_references_for_qwen_image_21(tmp_path):
    """before, before_2, before_3, then a Reference Images chain (of any picture sizes) write one pair of 10
    controls in that order; the references input is one optional input appended last."""
    node = nodes.QwenEditSavePair()
    optional = node.INPUT_TYPES()["optional"]
    assert list(optional) == ["mask", "before_2", "before_3", "references"]
    assert optional["references"][0] == nodes.QwenEditReferenceImages.RETURN_TYPES[0]
    assert all(spec[1]["tooltip"] for spec in optional.values())
    before = [_images(seed=k) for k in (1, 2, 3)]
    wide, tall = _images(4, seed=10), _images(3, seed=11, h=96, w=64)  # two sizes: two chained nodes
    (chain,) = nodes.QwenEditReferenceImages().collect(wide)
    (chain,) = nodes.QwenEditReferenceImages().collect(tall, references=chain)
    node.save(before[0], _images(seed=20), "x", str(tmp_path / "ten"), "ref", before_2=before[1],
              before_3=before[2], references=chain)
    expected = [_pixels(b[0]) for b in before] + [_pixels(row) for row in wide] + [_pixels(row) for row in tall]
    got = _saved_controls(tmp_path / "ten")
    assert len(got) == 10 and all(np.array_equal(g, e) for g, e in zip(got, expected))


def test_references_are_shared_by_a_batch_and_follow_the_last_connected_before(tmp_path):
    (chain,) = nodes.QwenEditReferenceImages().collect(_images(2, seed=7))
    nodes.QwenEditSavePair().save(_images(3, seed=1), _images(3, seed=2), "x", str(tmp_path / "b"), "p",
                                  references=chain)
    report = load_dataset(tmp_path / "b")
    assert [len(e.controls) for e in report.examples] == [3, 3, 3]
    for k, example in enumerate(report.examples):
        saved = [np.asarray(Image.open(p)) for p in example.controls]
        assert np.array_equal(saved[0], _pixels(_images(3, seed=1)[k]))
        assert all(np.array_equal(saved[1 + j], _pixels(_images(2, seed=7)[j])) for j in range(2))


def test_too_many_or_transparent_references_are_refused(tmp_path):
    node = nodes.QwenEditSavePair()
    (eight,) = nodes.QwenEditReferenceImages().collect(_images(8, seed=3))
    with pytest.raises(ValueError, match="at most 10 control \\(before\\) images.*got 11"):
        node.save(_images(), _images(), "x", str(tmp_path / "many"), "p", before_2=_images(), before_3=_images(),
                  references=eight)
    alpha = torch.zeros(1, H, W)
    alpha[0, :8] = 1.0  # Load Image's mask: the top rows transparent
    (clear,) = nodes.QwenEditReferenceImages().collect(_images(), mask=alpha)
    with pytest.raises(ValueError, match="reference 1 has transparency.*without a mask"):
        node.save(_images(), _images(), "x", str(tmp_path / "clear"), "p", references=clear)
    (opaque,) = nodes.QwenEditReferenceImages().collect(_images(seed=5), mask=torch.zeros(1, H, W))
    node.save(_images(), _images(), "x", str(tmp_path / "opaque"), "p", references=opaque)
    assert np.array_equal(_saved_controls(tmp_path / "opaque")[1], _pixels(_images(seed=5)[0]))
    assert not (tmp_path / "many").exists() and not (tmp_path / "clear").exists()


def test_a_folder_with_a_broken_pair_trains_on_the_saved_ones_as_the_summary_says(tiny_edit_dir, env):
    """Another pair of the folder without its caption is skipped by the summary and by the training job, which
    reads the folder again (a strict read would refuse it)."""
    folder = env / "pairs"
    folder.mkdir()
    Image.fromarray(np.zeros((H, W, 3), np.uint8)).save(folder / "old_control.png")
    Image.fromarray(np.zeros((H, W, 3), np.uint8)).save(folder / "old.png")  # no old.txt
    with torch.inference_mode():
        dataset, summary = nodes.QwenEditSavePair().save(_images(), _images(seed=1), "invert the colors",
                                                         str(folder), "pair")["result"]
        assert "1 problem(s) in other pairs skipped, first: " in summary and "old.txt" in summary
        (model,) = nodes.QwenEditModelLoader().load("", "cpu", "cpu", "cpu", "float32", path=str(tiny_edit_dir))
        (job,) = nodes.QwenEditTrainLoRA().start(model, dataset, "saved_pairs", 1, 1e-3, 4, "all", 1, 64, 0, False,
                                                 False)
    status = job.wait()
    assert status.state == "done", status.error
