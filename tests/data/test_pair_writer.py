"""Adding pairs to a dataset folder: both layouts, the running number, several controls, every problem before
anything is written, and no half pair left by a failed write."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from qwen_edit_core.data import pair_writer
from qwen_edit_core.data.dataset import load_dataset
from qwen_edit_core.data.pair_writer import NewPair, add_pairs


def _pil(w=96, h=64, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def _box_mask(w=96, h=64):
    mask = np.zeros((h, w), np.float32)
    mask[16:48, 8:40] = 1.0
    return mask


def test_flat_layout_numbers_and_masks(tmp_path):
    folder = tmp_path / "pairs"
    written, report = add_pairs(folder, [NewPair((_pil(seed=1),), _pil(seed=2), " invert the colors ", _box_mask())])
    assert [w.name for w in written] == ["pair_00001"]
    assert sorted(p.name for p in folder.iterdir()) == ["pair_00001.png", "pair_00001.txt", "pair_00001_control.png",
                                                        "pair_00001_mask.png"]
    assert written[0].files[-1] == folder / "pair_00001.png"  # the target last
    (example,) = report.examples
    assert example.caption == "invert the colors" and example.mask == folder / "pair_00001_mask.png"
    assert np.array_equal(np.asarray(Image.open(example.target)), np.asarray(_pil(seed=2)))
    mask = np.asarray(Image.open(example.mask))
    assert mask.dtype == np.uint8 and set(np.unique(mask)) == {0, 255} and mask[20, 10] == 255 and mask[0, 0] == 0

    written, report = add_pairs(folder, [NewPair((_pil(seed=3),), _pil(seed=4), "invert the colors"),
                                         NewPair((_pil(seed=5),), _pil(seed=6), "invert the colors")])
    assert [w.name for w in written] == ["pair_00002", "pair_00003"] and written[0].mask is None
    assert [e.name for e in report.examples] == ["pair_00001", "pair_00002", "pair_00003"]
    (folder / "other_00007.png").write_bytes(b"")  # another prefix does not count
    assert pair_writer.next_number(folder, "pair") == 4 and pair_writer.next_number(folder, "other") == 8


def test_folders_layout_and_several_controls(tmp_path):
    folder = tmp_path / "folders"
    for sub in ("images", "control_1"):
        (folder / sub).mkdir(parents=True)
    written, report = add_pairs(folder, [NewPair((_pil(seed=1), _pil(seed=2)), _pil(seed=3), "put them together",
                                                 _box_mask(48, 32))], prefix="edit")
    assert {p.relative_to(folder).as_posix() for p in written[0].files} == {
        "control_1/edit_00001.png", "control_2/edit_00001.png", "images/edit_00001.txt",
        "images/edit_00001_mask.png", "images/edit_00001.png"}
    (example,) = report.examples
    assert report.layout == "folders" and len(example.controls) == 2 and example.mask is not None

    flat = tmp_path / "flat"
    written, _ = add_pairs(flat, [NewPair((_pil(seed=1), _pil(seed=2)), _pil(seed=3), "x")])
    assert {p.name for p in written[0].files} == {"pair_00001_control_1.png", "pair_00001_control_2.png",
                                                  "pair_00001.txt", "pair_00001.png"}


def test_every_problem_is_reported_and_nothing_is_written(tmp_path):
    folder = tmp_path / "pairs"
    pairs = [NewPair((_pil(32, 32),), _pil(), "x", _box_mask(64, 64)),
             NewPair((_pil(),), _pil(), "  ", np.zeros((64, 96), np.float32)),
             NewPair((_pil(),), _pil(), "x", _box_mask() * 2)]
    with pytest.raises(ValueError) as err:
        add_pairs(folder, pairs)
    message = str(err.value)
    assert message.startswith("5 problem(s), nothing written")
    assert "pair 1: control (before) image is 32x32, too small" in message
    assert "pair 1: mask is 64x64 but the target (after) image is 96x64" in message
    assert "pair 2: caption is empty" in message and "pair 2: mask is empty" in message
    assert "pair 3: mask values must lie in [0, 1]" in message
    assert not folder.exists()
    for prefix in ("", "../x", ".hidden", "a_control"):
        with pytest.raises(ValueError, match="name prefix"):
            add_pairs(folder, [NewPair((_pil(),), _pil(), "x")], prefix=prefix)
    # a scaled copy of the target's mask is accepted (the dataset reads masks of the target's aspect)
    written, _ = add_pairs(folder, [NewPair((_pil(),), _pil(), "x", _box_mask(48, 32))])
    assert written[0].mask is not None


def test_eleven_controls_and_captions_with_control_characters_are_refused(tmp_path):
    folder = tmp_path / "pairs"
    pairs = [NewPair(tuple(_pil(seed=k) for k in range(11)), _pil(), "x"),
             NewPair((_pil(),), _pil(), "make it\x00 blue"), NewPair((_pil(),), _pil(), "make it \x1b[31mred")]
    with pytest.raises(ValueError) as err:
        add_pairs(folder, pairs)
    message = str(err.value)
    assert "pair 1: a pair takes at most 10 control (before) images (Qwen-Image-2.1), got 11" in message
    assert "pair 2: caption holds the control character U+0000 at character 7" in message
    assert "pair 3: caption holds the control character U+001B" in message
    assert not folder.exists()
    # ten references (Qwen-Image-2.1's most) are written in order and read back as one pair
    written, report = add_pairs(tmp_path / "ten", [NewPair(tuple(_pil(seed=k) for k in range(10)), _pil(), "x")])
    assert [len(e.controls) for e in report.examples] == [10]
    assert [p.name for p in report.examples[0].controls] == [f"pair_00001_control_{i}.png" for i in range(1, 11)]
    # a caption with a line break is text for the writer as for the dataset reader: written and read back
    written, report = add_pairs(folder, [NewPair((_pil(),), _pil(), "make the sky\nblue")])
    assert report.examples[0].caption == "make the sky\nblue"


def test_a_failed_write_leaves_no_half_pair(tmp_path, monkeypatch):
    folder = tmp_path / "pairs"
    add_pairs(folder, [NewPair((_pil(),), _pil(), "x")])
    before = sorted(p.name for p in folder.iterdir())
    real, calls = pair_writer.write_bytes, []

    def failing(path, data):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device", str(path))
        return real(path, data)

    monkeypatch.setattr(pair_writer, "write_bytes", failing)
    with pytest.raises(OSError, match="could not write pair 'pair_00002' .*: the disk is full"):
        add_pairs(folder, [NewPair((_pil(),), _pil(), "x", _box_mask())])
    assert sorted(p.name for p in folder.iterdir()) == before and len(load_dataset(folder).examples) == 1
