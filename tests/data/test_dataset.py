"""Dataset discovery and validation: both layouts, every problem named at once, buckets, resumable sampler."""

from __future__ import annotations

import io
import logging
import math

import numpy as np
import pytest
from PIL import Image, ImageFile

from qwen_edit_core.data.dataset import (BucketBatchSampler, DatasetError, DatasetReport, EditExample, Problem,
                                    bucket_for, calculate_dimensions, check_image, load_dataset, load_rgb)


def _rgb(path, w=80, h=64, seed=0, fmt=None):
    """A random RGB image of w x h saved to `path` (format from the suffix unless `fmt`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    Image.fromarray(arr).save(path, format=fmt)
    return path


def _caption(path, text="make it blue"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _pair(folder, name, ext="png", n_controls=1):
    """A valid flat-layout sample: NAME.ext, NAME_control[_i].png, NAME.txt."""
    _rgb(folder / f"{name}.{ext}")
    if n_controls == 1:
        _rgb(folder / f"{name}_control.png", seed=1)
    for i in range(1, n_controls + 1 if n_controls > 1 else 1):
        _rgb(folder / f"{name}_control_{i}.png", seed=i)
    _caption(folder / f"{name}.txt")


def _line_for(message, name):
    """The line of an error message about file `name`."""
    return next((row for row in message.splitlines() if f"/{name}:" in row), None)


# -- layouts ---------------------------------------------------------------------------------------------------

def test_folder_layout_with_two_controls_and_formats(tmp_path):
    for i, ext in enumerate(("png", "jpg", "jpeg", "webp")):
        _rgb(tmp_path / "images" / f"s{i}.{ext}", seed=i)
        _rgb(tmp_path / "control_1" / f"s{i}.png", seed=10 + i)
        _rgb(tmp_path / "control_2" / f"s{i}.JPG", 64, 128, seed=20 + i, fmt="JPEG")
        (tmp_path / "images" / f"s{i}.txt").write_text("\ufeff  make it blue  \n", encoding="utf-8")
    report = load_dataset(tmp_path)
    assert isinstance(report, DatasetReport) and report.layout == "folders" and report.skipped == ()
    assert [e.name for e in report.examples] == ["s0", "s1", "s2", "s3"]
    ex = report.examples[0]
    assert isinstance(ex, EditExample) and ex.caption == "make it blue"
    assert ex.controls == (tmp_path / "control_1" / "s0.png", tmp_path / "control_2" / "s0.JPG")
    assert ex.target_size == (80, 64) and ex.control_sizes == ((80, 64), (64, 128))


def test_folder_layout_control_counts_as_one_and_captions_folder(tmp_path):
    _rgb(tmp_path / "images" / "a.png")
    _rgb(tmp_path / "control" / "a.webp", seed=1)
    _rgb(tmp_path / "control_2" / "a.png", seed=2)
    _caption(tmp_path / "captions" / "a.txt", "from captions/")
    _rgb(tmp_path / "images" / "b.png")
    _rgb(tmp_path / "control" / "b.png", seed=1)
    _rgb(tmp_path / "control_2" / "b.png", seed=2)
    _caption(tmp_path / "images" / "b.txt", "beside the image")
    _caption(tmp_path / "captions" / "b.txt", "shadowed")
    report = load_dataset(tmp_path)
    a, b = report.examples
    assert a.controls == (tmp_path / "control" / "a.webp", tmp_path / "control_2" / "a.png")
    assert a.caption == "from captions/" and b.caption == "beside the image"
    assert any(n.path == tmp_path / "captions" / "b.txt" for n in report.notes)


def test_flat_layout_one_and_two_controls(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    for i, ext in enumerate(("png", "jpg", "webp")):
        _pair(one, f"n{i}", ext=ext)
        _pair(two, f"m{i}", ext=ext, n_controls=2)
    (one / "n0.txt").write_text("édit ✓", encoding="utf-8")
    report = load_dataset(one)
    assert report.layout == "flat" and [e.name for e in report.examples] == ["n0", "n1", "n2"]
    assert report.examples[0].caption == "édit ✓" and report.examples[0].controls == (one / "n0_control.png",)
    report = load_dataset(two)
    assert [e.controls for e in report.examples][0] == (two / "m0_control_1.png", two / "m0_control_2.png")


def test_layout_ambiguities_stop_discovery(tmp_path):
    _rgb(tmp_path / "images" / "a.png")
    _rgb(tmp_path / "control" / "a.png")
    _rgb(tmp_path / "control_1" / "a.png")
    _rgb(tmp_path / "control_3" / "a.png")
    with pytest.raises(DatasetError) as err:
        load_dataset(tmp_path)
    assert "control_1/" in str(err.value) and "keep one" in str(err.value)
    gap = tmp_path / "gap"
    _rgb(gap / "images" / "a.png")
    _rgb(gap / "control_1" / "a.png")
    _rgb(gap / "control_3" / "a.png")
    with pytest.raises(DatasetError, match=r"numbered \[1, 3\]"):
        load_dataset(gap)
    lost = tmp_path / "lost"
    _rgb(lost / "control" / "a.png")
    with pytest.raises(DatasetError, match="no images/ folder"):
        load_dataset(lost)


def test_missing_and_empty_folders(tmp_path):
    with pytest.raises(DatasetError, match="does not exist") as err:
        load_dataset(tmp_path / "nope")
    assert isinstance(err.value, FileNotFoundError) and "accepted layouts" in str(err.value)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("x")
    with pytest.raises(DatasetError, match="accepted layouts") as err:
        load_dataset(tmp_path / "empty")
    assert str(tmp_path / "empty") in str(err.value)


# -- problems --------------------------------------------------------------------------------------------------

def _bad_dataset(tmp_path):
    """One good flat sample plus one of every problem; returns {file name: expected words in its line}."""
    _pair(tmp_path, "ok")
    cases = {}
    buf = io.BytesIO()
    _ = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8)).save(buf, format="PNG")
    (tmp_path / "trunc.png").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    cases["trunc.png"] = "truncated"
    Image.new("RGBA", (64, 64)).save(tmp_path / "rgba.png")
    cases["rgba.png"] = "mode RGBA"
    Image.new("P", (64, 64)).save(tmp_path / "pal.png")
    cases["pal.png"] = "mode P"
    Image.new("I;16", (64, 64)).save(tmp_path / "deep.png")
    cases["deep.png"] = "16-bit"
    Image.new("CMYK", (64, 64)).save(tmp_path / "cmyk.jpg")
    cases["cmyk.jpg"] = "mode CMYK"
    _rgb(tmp_path / "small.png", 20, 20)
    cases["small.png"] = "at least 64 px"
    for stem in ("trunc", "rgba", "pal", "deep", "cmyk", "small"):
        _rgb(tmp_path / f"{stem}_control.png")
        _caption(tmp_path / f"{stem}.txt")
    _rgb(tmp_path / "orphan_control.png")
    cases["orphan_control.png"] = "no target"
    _rgb(tmp_path / "nocap.png")
    _rgb(tmp_path / "nocap_control.png")
    cases["nocap.txt"] = "caption file is missing"
    _pair(tmp_path, "empty")
    (tmp_path / "empty.txt").write_text(" \ufeff \n")
    cases["empty.txt"] = "caption is empty"
    _pair(tmp_path, "latin")
    (tmp_path / "latin.txt").write_bytes("café".encode("latin-1"))
    cases["latin.txt"] = "not UTF-8"
    _rgb(tmp_path / "lonely.png")
    _caption(tmp_path / "lonely.txt")
    cases["lonely.png"] = "no control image"
    _pair(tmp_path, "dup")
    _rgb(tmp_path / "dup.webp")
    cases["dup.webp"] = "same name as dup.png"
    Image.new("RGB", (64, 64)).save(tmp_path / "anim.gif")
    cases["anim.gif"] = "not accepted"
    _pair(tmp_path, "gap", n_controls=2)
    (tmp_path / "gap_control_2.png").rename(tmp_path / "gap_control_3.png")
    cases["gap.png"] = "numbered [1, 3]"
    return cases


def test_every_problem_named_at_once(tmp_path):
    cases = _bad_dataset(tmp_path)
    with pytest.raises(DatasetError) as err:
        load_dataset(tmp_path)
    message = str(err.value)
    assert message.splitlines()[0].startswith(f"{len(cases)} problem(s)")
    assert len(err.value.problems) == len(cases) == len(message.splitlines()) - 1
    assert all(isinstance(p, Problem) for p in err.value.problems)
    for name, why in cases.items():
        line = _line_for(message, name)
        assert line is not None and why in line, (name, message)
    assert "must be RGB" in _line_for(message, "rgba.png") and "convert_modes" in _line_for(message, "rgba.png")


def test_skip_invalid_counts_and_continues(tmp_path, caplog):
    cases = _bad_dataset(tmp_path)
    with caplog.at_level(logging.WARNING, logger="qwen_edit_core.data.dataset"):
        report = load_dataset(tmp_path, skip_invalid=True)
    assert [e.name for e in report.examples] == ["ok"] and len(report.skipped) == len(cases)
    assert "skipped 12 sample(s) over 14 problem(s)" in caplog.text and "1 sample(s) remain" in caplog.text


def test_empty_after_skipping_is_an_error(tmp_path):
    _rgb(tmp_path / "small.png", 20, 20)
    _rgb(tmp_path / "small_control.png")
    _caption(tmp_path / "small.txt")
    with pytest.raises(DatasetError, match="no valid edit pairs left") as err:
        load_dataset(tmp_path, skip_invalid=True)
    assert str(tmp_path) in str(err.value) and len(err.value.problems) == 1


def test_links_leaving_the_dataset_folder_are_refused_by_name(tmp_path):
    data, outside = tmp_path / "data", tmp_path / "outside"
    for name in ("a", "b", "c", "d", "e", "f"):
        _pair(data, name)
    _caption(outside / "secret.txt", "root:x:0:0:root:/root:/bin/bash")
    (data / "a.txt").unlink()
    (data / "a.txt").symlink_to(outside / "secret.txt")
    _rgb(outside / "picture.png")
    (data / "b.png").unlink()
    (data / "b.png").symlink_to(outside / "picture.png")
    (data / "c.txt").unlink()
    (data / "c.txt").symlink_to(data / "d.txt")  # a link inside the dataset is fine
    (data / "e_control.png").unlink()
    (data / "e_control.png").symlink_to(outside / "picture.png")
    Image.new("L", (80, 64), 255).save(outside / "mask.png")
    (data / "f_mask.png").symlink_to(outside / "mask.png")
    with pytest.raises(DatasetError) as err:
        load_dataset(data)
    message = str(err.value)
    assert "4 problem(s)" in message
    assert f"is a link to '{outside / 'secret.txt'}', outside the dataset folder" in _line_for(message, "a.txt")
    assert f"is a link to '{outside / 'picture.png'}', outside the dataset folder" in _line_for(message, "b.png")
    assert f"is a link to '{outside / 'picture.png'}', outside" in _line_for(message, "e_control.png")
    assert f"is a link to '{outside / 'mask.png'}', outside" in _line_for(message, "f_mask.png")
    report = load_dataset(data, skip_invalid=True)
    assert [e.name for e in report.examples] == ["c", "d"] and "root:x" not in report.examples[0].caption


def test_captions_with_control_characters_or_over_the_size_bound_are_refused(tmp_path):
    from qwen_edit_core.data.captions import MAX_CAPTION_BYTES
    for name in ("a", "b", "c"):
        _pair(tmp_path, name)
    _caption(tmp_path / "a.txt", "make it\x00 blue")
    (tmp_path / "b.txt").write_bytes(b"x" * (1 << 20))
    _caption(tmp_path / "c.txt", "make the sky\nblue\tnow")  # line breaks and tabs are text
    with pytest.raises(DatasetError) as err:
        load_dataset(tmp_path)
    message = str(err.value)
    assert "control character U+0000 at character 7" in _line_for(message, "a.txt")
    assert f"caption is {1 << 20} bytes, more than the text encoder's 1024 tokens can hold (captions over " \
           f"{MAX_CAPTION_BYTES} bytes are refused)" in _line_for(message, "b.txt")
    assert _line_for(message, "c.txt") is None


def test_truncated_image_fails_even_when_pillow_is_told_to_load_truncated(tmp_path, monkeypatch):
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8)).save(buf, format="JPEG")
    path = tmp_path / "cut.jpg"
    path.write_bytes(buf.getvalue()[:-200])
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    size, problem = check_image(path, min_side=64, max_pixels=10**6, convert_modes=False)
    assert size is None and "truncated" in problem
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # restored for the host


def test_decompression_bombs(tmp_path, monkeypatch):
    _pair(tmp_path, "big")
    _rgb(tmp_path / "big.png", 300, 300)
    with pytest.raises(DatasetError, match="pixel limit") as err:
        load_dataset(tmp_path, max_pixels=200 * 200)
    assert _line_for(str(err.value), "big.png") is not None
    # Pillow's own hard limit (twice MAX_IMAGE_PIXELS) fires inside Image.open: reported, not raised.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100 * 100)
    with pytest.raises(DatasetError, match="absurdly large"):
        load_dataset(tmp_path)


# -- modes and orientation -------------------------------------------------------------------------------------

def test_convert_modes_accepts_and_converts(tmp_path, caplog):
    _pair(tmp_path, "a")
    Image.new("RGBA", (64, 64), (255, 0, 0, 0)).save(tmp_path / "a.png")
    _pair(tmp_path, "b")
    Image.fromarray(np.full((64, 64), 65535, np.uint16)).save(tmp_path / "b.png")
    _pair(tmp_path, "c")
    Image.new("CMYK", (64, 64), (0, 0, 0, 0)).save(tmp_path / "c.jpg")
    (tmp_path / "c.png").unlink()
    with caplog.at_level(logging.WARNING, logger="qwen_edit_core.data.dataset"):
        report = load_dataset(tmp_path, convert_modes=True)
    assert [e.name for e in report.examples] == ["a", "b", "c"]
    assert "RGBA" in caplog.text and "composited on white" in caplog.text
    assert load_rgb(tmp_path / "a.png", convert_modes=True).getpixel((0, 0)) == (255, 255, 255)
    assert load_rgb(tmp_path / "b.png", convert_modes=True).getpixel((0, 0)) == (255, 255, 255)
    cmyk = load_rgb(tmp_path / "c.jpg", convert_modes=True)
    assert cmyk.mode == "RGB" and min(cmyk.getpixel((0, 0))) > 240
    with pytest.raises(ValueError, match="RGBA"):
        load_rgb(tmp_path / "a.png")


def test_exif_rotation_is_applied_and_noted(tmp_path):
    img = Image.fromarray(np.zeros((64, 96, 3), np.uint8))  # 96 wide, 64 high as stored
    exif = img.getexif()
    exif[0x0112] = 6  # displayed rotated 90 degrees: 64 wide, 96 high
    img.save(tmp_path / "r.jpg", exif=exif)
    _rgb(tmp_path / "r_control.png")
    _caption(tmp_path / "r.txt")
    report = load_dataset(tmp_path)
    (example,) = report.examples
    assert example.target_size == (64, 96) and load_rgb(tmp_path / "r.jpg").size == (64, 96)
    assert report.skipped == () and any("EXIF orientation 6" in n.message for n in report.notes)


# -- buckets ---------------------------------------------------------------------------------------------------

def test_calculate_dimensions_matches_diffusers():
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions as reference
    for area in (1024 * 1024, 512 * 512, 384 * 384, 64 * 64, 1000 * 777):
        for ratio in (1.0, 4 / 3, 3 / 4, 16 / 9, 9 / 16, 0.3, 2.7, 21 / 9, math.pi, 1 / math.e):
            assert calculate_dimensions(area, ratio) == reference(area, ratio), (area, ratio)
        for w in range(100, 4000, 37):  # real image sizes, including ties of round()
            assert calculate_dimensions(area, w / 1000) == reference(area, w / 1000)
    assert bucket_for((1600, 900), 1024 * 1024) == (1376, 768)
    assert all(side % 32 == 0 for side in bucket_for((1234, 567), 512 * 512))


# -- sampler ---------------------------------------------------------------------------------------------------

KEYS = [(64, 64), (96, 64), (64, 64), (96, 64), (64, 64), (64, 96), (64, 64), (96, 64), (64, 64), (64, 64)]


def test_bucket_sampler_groups_equal_buckets_and_is_deterministic():
    s = BucketBatchSampler(KEYS, batch_size=2, seed=5)
    batches = s.epoch_batches(0)
    assert all(len({KEYS[i] for i in b}) == 1 for b in batches)
    assert sorted(i for b in batches for i in b) == list(range(len(KEYS)))
    assert BucketBatchSampler(KEYS, 2, seed=5).epoch_batches(0) == batches
    assert BucketBatchSampler(KEYS, 2, seed=6).epoch_batches(0) != batches
    assert s.epoch_batches(1) != batches
    full = BucketBatchSampler(KEYS, 2, seed=5, drop_last=True).epoch_batches(0)
    assert all(len(b) == 2 for b in full) and len(full) == 4  # 6 square -> 3, 3 wide -> 1, 1 tall -> 0
    ordered = BucketBatchSampler(KEYS, 4, seed=5, shuffle=False).epoch_batches(3)
    assert ordered == [[0, 2, 4, 6], [8, 9], [5], [1, 3, 7]]  # groups in key order, indices in order


def test_bucket_sampler_resume_yields_the_same_remaining_sequence():
    s = BucketBatchSampler(KEYS, batch_size=2, seed=5)
    per_epoch = len(s.epoch_batches(0))
    it = iter(s)
    first = [next(it) for _ in range(per_epoch + 2)]
    assert first[:per_epoch] == s.epoch_batches(0) and first[per_epoch:] == s.epoch_batches(1)[:2]
    state = s.state_dict()
    assert state["epoch"] == 1 and state["index"] == 2 and all(type(v) is int for v in state.values())
    rest = [next(it) for _ in range(3 * per_epoch)]
    resumed = BucketBatchSampler(KEYS, 2, seed=5)
    resumed.load_state_dict(dict(state))
    it2 = iter(resumed)
    assert [next(it2) for _ in range(3 * per_epoch)] == rest
    with pytest.raises(ValueError, match="epoch"):
        resumed.load_state_dict({"epoch": -1, "index": 0})


def test_bucket_sampler_similar_grouping_and_bad_arguments():
    sizes = [w * h for w, h in KEYS]
    s = BucketBatchSampler(KEYS, batch_size=3, seed=1, sizes=sizes)
    batches = s.epoch_batches(0)
    assert sorted(i for b in batches for i in b) == list(range(len(KEYS)))
    assert s.epoch_batches(0) == batches
    with pytest.raises(ValueError, match="batch_size"):
        BucketBatchSampler(KEYS, 0, seed=1)
    with pytest.raises(ValueError, match="no full batch"):
        BucketBatchSampler(KEYS, 20, seed=1, drop_last=True).epoch_batches(0)
