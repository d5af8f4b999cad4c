"""Region masks: discovery in both layouts, invalid masks reported with the dataset's problems, area
averaging onto the token grid, the cache key and entry."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from qwen_edit_core.data.dataset import DatasetError, load_dataset
from qwen_edit_core.data.masks import mask_tokens

from tolerances import assert_close_fp32


def _rgb(path, w=64, h=64, seed=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)


def _mask(path, w=64, h=64, box=(0, 0, 32, 64), mode="L", value=255):
    """A black mask with a white box (x0, y0, x1, y1)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = np.zeros((h, w), dtype=np.uint8)
    x0, y0, x1, y1 = box
    arr[y0:y1, x0:x1] = value
    Image.fromarray(arr).convert(mode).save(path)
    return path


def _flat(folder, names=("a", "b", "c"), w=64, h=64):
    for i, name in enumerate(names):
        _rgb(folder / f"{name}.png", w, h, seed=i)
        _rgb(folder / f"{name}_control.png", w, h, seed=10 + i)
        (folder / f"{name}.txt").write_text("make it blue")
    return folder


def test_masks_are_found_beside_the_target_and_in_masks_folder(tmp_path):
    flat = _flat(tmp_path / "flat")
    _mask(flat / "a_mask.png")
    _mask(flat / "masks" / "b.png")
    by_name = {e.name: e for e in load_dataset(flat).examples}
    assert set(by_name) == {"a", "b", "c"}
    assert by_name["a"].mask == flat / "a_mask.png" and by_name["b"].mask == flat / "masks" / "b.png"
    assert by_name["c"].mask is None

    folders = tmp_path / "folders"
    for i, name in enumerate(("a", "b")):
        _rgb(folders / "images" / f"{name}.png", seed=i)
        _rgb(folders / "control" / f"{name}.png", seed=5 + i)
        (folders / "images" / f"{name}.txt").write_text("make it blue")
    _mask(folders / "images" / "a_mask.png")
    _mask(folders / "masks" / "b.png")
    by_name = {e.name: e for e in load_dataset(folders).examples}
    assert by_name["a"].mask == folders / "images" / "a_mask.png"
    assert by_name["b"].mask == folders / "masks" / "b.png"


def test_a_target_named_like_a_mask_stays_a_target(tmp_path):
    folder = _flat(tmp_path / "d", names=("x_mask",))
    (example,) = load_dataset(folder).examples
    assert example.name == "x_mask" and example.mask is None


def test_invalid_masks_are_reported_with_the_other_problems(tmp_path):
    folder = _flat(tmp_path / "d", names=("a", "b", "c", "d", "e", "f"))
    _mask(folder / "a_mask.png", w=64, h=32)                                     # wrong aspect
    _mask(folder / "b_mask.png", value=0)                                        # all black
    Image.fromarray(np.dstack([np.full((64, 64), v, np.uint8) for v in (255, 0, 0)])).save(folder / "c_mask.png")
    Image.new("CMYK", (64, 64), (0, 0, 0, 0)).save(folder / "d_mask.jpg")        # not greyscale-convertible
    _mask(folder / "masks" / "zzz.png")                                          # no target
    (folder / "e.txt").write_text("")                                            # a caption problem too
    _mask(folder / "f_mask.png", w=128, h=128, mode="RGB")                       # valid: scaled, grey RGB
    with pytest.raises(DatasetError) as err:
        load_dataset(folder)
    text = str(err.value)
    assert "a_mask.png: mask is 64x32" in text and "aspect differs" in text
    assert "b_mask.png: mask is all black" in text
    assert "c_mask.png: mask has colours" in text
    assert "d_mask.jpg: mask mode CMYK" in text
    assert "zzz.png: mask has no target" in text and "e.txt: caption is empty" in text
    assert "f_mask" not in text
    report = load_dataset(folder, skip_invalid=True)
    assert [e.name for e in report.examples] == ["f"] and len(report.skipped) == 6


def test_mask_is_area_averaged_onto_the_token_grid(tmp_path):
    """A 96x64 mask onto a 48x32 target bucket (3x2 tokens of 16 px): the white box x in [0, 48) covers the first
    token column fully and half of the second (in the bucket's pixels: 24 of 48 px)."""
    path = _mask(tmp_path / "m.png", w=96, h=64, box=(0, 0, 48, 64))
    tokens = mask_tokens(path, 48, 32)
    assert tokens.dtype == torch.float32 and tokens.shape == (6,)
    # sums of 0s and 1s over 32 x 32 pixels, divided by 1024: every step exact
    assert tokens.tolist() == [1.0, 0.5, 0.0, 1.0, 0.5, 0.0]
    grey = _mask(tmp_path / "g.png", w=32, h=32, box=(0, 0, 32, 32), value=128)
    # the mean of a token's 16 x 16 pixels of 128 / 255: up to 256 roundings in the sum
    assert_close_fp32(mask_tokens(grey, 32, 32), torch.full((4,), 128 / 255), ops=16 * 16, what="grey mask tokens")


def test_the_mask_enters_the_cache_key_and_entry(tiny_edit_dir, tmp_path):
    from conftest import train_config
    from qwen_edit_core import QwenImageEditTrainer
    from qwen_edit_core.data.example_tensors import cache_key, encoder_identity
    folder = _flat(tmp_path / "d", names=("a",))
    trainer = QwenImageEditTrainer(train_config(tiny_edit_dir, folder, tmp_path / "o"))
    settings = trainer.encode_settings("edit")
    identity = encoder_identity(tiny_edit_dir)
    (plain,) = trainer.dataset().examples
    _mask(folder / "a_mask.png")
    (masked,) = trainer.dataset().examples
    key_plain, key_masked = cache_key(plain, settings, identity), cache_key(masked, settings, identity)
    assert key_plain.mask_hash == "" and key_masked.mask_hash and key_plain.digest() != key_masked.digest()
    _mask(folder / "a_mask.png", box=(0, 0, 16, 64))
    assert cache_key(masked, settings, identity).digest() != key_masked.digest()
    trainer.cache([plain, masked])
    entry = trainer._cache().get(cache_key(masked, settings, identity))
    assert "loss_mask" not in trainer._cache().get(key_plain)
    assert entry["loss_mask"].dtype == torch.float32
    assert entry["loss_mask"].tolist() == [1.0, 0.0, 0.0, 0.0] * 4  # 4x4 tokens: sums of 0s and 1s, exact
