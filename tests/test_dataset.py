"""Dataset discovery and validation: both layouts, every problem named at once, buckets, resumable sampler."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from PIL import Image

from qwen_edit_core.dataset import (BucketBatchSampler, DatasetError, bucket_for, calculate_dimensions,
                                    load_dataset, load_rgb)


def _rgb(path, w=80, h=64, seed=0, fmt=None):
    arr = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    Image.fromarray(arr).save(path, format=fmt)
    return path


def test_folder_layout_with_two_controls_and_formats(tmp_path):
    for d in ("images", "control_1", "control_2"):
        (tmp_path / d).mkdir()
    for i, ext in enumerate(("png", "jpg", "webp")):
        _rgb(tmp_path / "images" / f"s{i}.{ext}", seed=i)
        _rgb(tmp_path / "control_1" / f"s{i}.png", seed=10 + i)
        _rgb(tmp_path / "control_2" / f"s{i}.JPG", 64, 128, seed=20 + i, fmt="JPEG")
        (tmp_path / "images" / f"s{i}.txt").write_text("\ufeffmake it blue  \n", encoding="utf-8")
    report = load_dataset(tmp_path)
    assert report.layout == "folders" and len(report.examples) == 3
    ex = report.examples[0]
    assert ex.caption == "make it blue" and len(ex.controls) == 2 and ex.control_sizes[1] == (64, 128)


def test_flat_layout(tmp_path):
    for i in range(2):
        _rgb(tmp_path / f"n{i}.png")
        _rgb(tmp_path / f"n{i}_control.png")
        (tmp_path / f"n{i}.txt").write_text("édit ✓", encoding="utf-8")
    report = load_dataset(tmp_path)
    assert report.layout == "flat" and [e.name for e in report.examples] == ["n0", "n1"]
    assert report.examples[0].caption == "édit ✓"


def _bad_dataset(tmp_path):
    good = ["ok"]
    for name in good:
        _rgb(tmp_path / f"{name}.png")
        _rgb(tmp_path / f"{name}_control.png")
        (tmp_path / f"{name}.txt").write_text("fine")
    cases = {}
    # truncated png
    buf = io.BytesIO()
    Image.fromarray(np.zeros((64, 64, 3), np.uint8) + 100).save(buf, format="PNG")
    (tmp_path / "trunc.png").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    cases["trunc.png"] = "truncated"
    Image.new("RGBA", (64, 64)).save(tmp_path / "rgba.png")
    cases["rgba.png"] = "mode RGBA"
    Image.new("P", (64, 64)).save(tmp_path / "pal.png")
    cases["pal.png"] = "mode P"
    Image.new("I;16", (64, 64)).save(tmp_path / "deep.png")
    cases["deep.png"] = "not RGB"
    Image.new("CMYK", (64, 64)).save(tmp_path / "cmyk.jpg")
    cases["cmyk.jpg"] = "mode CMYK"
    _rgb(tmp_path / "small.png", 20, 20)
    cases["small.png"] = "smaller than"
    for stem in ("trunc", "rgba", "pal", "deep", "cmyk", "small"):
        _rgb(tmp_path / f"{stem}_control.png")
        (tmp_path / f"{stem}.txt").write_text("x")
    _rgb(tmp_path / "orphan_control.png")
    cases["orphan_control.png"] = "no target"
    _rgb(tmp_path / "nocap.png")
    _rgb(tmp_path / "nocap_control.png")
    cases["nocap.txt"] = "caption file is missing"
    _rgb(tmp_path / "empty.png")
    _rgb(tmp_path / "empty_control.png")
    (tmp_path / "empty.txt").write_text("   \n")
    cases["empty.txt"] = "caption is empty"
    _rgb(tmp_path / "lonely.png")
    (tmp_path / "lonely.txt").write_text("x")
    cases["lonely.png"] = "no control image"
    return cases


def test_every_problem_named_at_once(tmp_path):
    cases = _bad_dataset(tmp_path)
    with pytest.raises(DatasetError) as err:
        load_dataset(tmp_path)
    message = str(err.value)
    assert f"{len(cases)} problem(s)" in message
    for name, why in cases.items():
        line = next((row for row in message.splitlines() if f"/{name}:" in row), None)
        assert line is not None and why in line, (name, message)


def test_skip_invalid_counts_and_continues(tmp_path):
    cases = _bad_dataset(tmp_path)
    report = load_dataset(tmp_path, skip_invalid=True)
    assert [e.name for e in report.examples] == ["ok"] and len(report.skipped) == len(cases)


def test_convert_modes_and_exif(tmp_path):
    Image.new("RGBA", (64, 64), (255, 0, 0, 0)).save(tmp_path / "a.png")
    assert load_rgb(tmp_path / "a.png", convert_modes=True).getpixel((0, 0)) == (255, 255, 255)
    with pytest.raises(ValueError, match="RGBA"):
        load_rgb(tmp_path / "a.png")
    img = Image.fromarray(np.zeros((64, 96, 3), np.uint8))
    exif = img.getexif()
    exif[0x0112] = 6  # rotated 90 degrees
    img.save(tmp_path / "r.jpg", exif=exif)
    _rgb(tmp_path / "r_control.png")
    (tmp_path / "r.txt").write_text("x")
    report = load_dataset(tmp_path / ".", skip_invalid=True)
    rotated = next(e for e in report.examples if e.name == "r")
    assert rotated.target_size == (64, 96) and load_rgb(tmp_path / "r.jpg").size == (64, 96)


def test_decompression_bomb_and_missing_folder(tmp_path):
    _rgb(tmp_path / "big.png", 300, 300)
    _rgb(tmp_path / "big_control.png")
    (tmp_path / "big.txt").write_text("x")
    with pytest.raises(DatasetError, match="pixel limit"):
        load_dataset(tmp_path, max_pixels=200 * 200)
    with pytest.raises(DatasetError, match="does not exist"):
        load_dataset(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="accepted layouts"):
        load_dataset(tmp_path / "empty")


def test_calculate_dimensions_matches_diffusers():
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions as reference
    for area in (1024 * 1024, 384 * 384, 64 * 64):
        for ratio in (1.0, 4 / 3, 3 / 4, 16 / 9, 0.3, 2.7, math.pi):
            assert calculate_dimensions(area, ratio) == reference(area, ratio)
    assert bucket_for((1600, 900), 1024 * 1024) == (1376, 768)


def test_bucket_sampler_groups_is_deterministic_and_resumes():
    keys = ["a", "b", "a", "b", "a", "c", "a", "b"]
    s = BucketBatchSampler(keys, batch_size=2, seed=5)
    batches = s.epoch_batches(0)
    assert all(len({keys[i] for i in b}) == 1 for b in batches)
    assert sorted(i for b in batches for i in b) == list(range(8))
    assert BucketBatchSampler(keys, 2, seed=5).epoch_batches(0) == batches
    it = iter(s)
    first = [next(it) for _ in range(7)]
    state = s.state_dict()
    rest = [next(it) for _ in range(5)]
    resumed = BucketBatchSampler(keys, 2, seed=5)
    resumed.load_state_dict(state)
    it2 = iter(resumed)
    assert [next(it2) for _ in range(5)] == rest
    assert first[:len(batches)] == batches
