"""Dataset From Folder's keep_captionless: a dataset with pairs that have no caption reaches the Dataset Doctor,
which proposes their captions with a text encoder connected, while Build Cache and Train refuse those pairs as
before (skip_invalid off) or leave them out (skip_invalid on, which reaches the training job)."""

from __future__ import annotations

import pytest
import torch

import nodes
from conftest import make_pairs
from qwen_edit_core.data.dataset import DatasetError

MISSING = "p1.txt: caption file is missing"


def _captionless_pairs(folder):
    """Three pairs, the second without its caption file."""
    make_pairs(folder, n=3)
    (folder / "p1.txt").unlink()
    return folder


def _load(model_dir):
    with torch.inference_mode():
        return nodes.QwenEditModelLoader().load("", "cpu", "cpu", "cpu", "float32", path=str(model_dir))[0]


def test_the_new_input_goes_last_with_a_tooltip_and_off_refuses_as_before(tmp_path):
    optional = nodes.QwenEditDataset.INPUT_TYPES()["optional"]
    assert list(optional) == ["keep_captionless"] and optional["keep_captionless"][1]["tooltip"]
    with pytest.raises(DatasetError, match=MISSING):
        nodes.QwenEditDataset().load(str(_captionless_pairs(tmp_path / "pairs")), False)


def test_kept_captionless_pairs_reach_the_doctor_which_proposes_their_captions(tiny_plus_dir, tmp_path, monkeypatch):
    from qwen_edit_core.model.components import load_text_encoder
    monkeypatch.setenv("QWEN_EDIT_OUTPUT", str(tmp_path / "output"))
    folder = _captionless_pairs(tmp_path / "pairs")
    dataset, summary = nodes.QwenEditDataset().load(str(folder), False, keep_captionless=True)["result"]
    assert [e.name for e in dataset.report.examples] == ["p0", "p2"] and dataset.captionless == ("p1",)
    assert "1 without a caption (first: p1), for Dataset Doctor: training refuses them" in summary
    encoder = load_text_encoder(tiny_plus_dir, device=torch.device("cpu"), dtype=torch.float32)
    _, found = nodes.QwenEditDatasetDoctor().check(dataset, False, text_encoder=encoder)["result"]
    assert "1 pair(s) without a caption described (first: p1" in found


def test_build_cache_and_train_refuse_kept_captionless_pairs_as_before(tiny_edit_dir, env):
    folder = _captionless_pairs(env / "pairs")
    dataset, _ = nodes.QwenEditDataset().load(str(folder), False, keep_captionless=True)["result"]
    model = _load(tiny_edit_dir)
    with torch.inference_mode():
        with pytest.raises(DatasetError, match=MISSING):
            nodes.QwenEditBuildCache().build(model, dataset, 64, str(env / "cache"))
        with pytest.raises(DatasetError, match=MISSING):
            nodes.QwenEditTrainLoRA().start(model, dataset, "refused", 1, 1e-3, 4, "all", 1, 64, 0, False, False)


def test_skip_invalid_leaves_them_out_of_the_training_job_too(tiny_edit_dir, env):
    """skip_invalid reaches the job, which reads the folder again: it trains on the captioned pairs."""
    folder = _captionless_pairs(env / "pairs")
    dataset, summary = nodes.QwenEditDataset().load(str(folder), True, keep_captionless=True)["result"]
    assert "training leaves them out" in summary
    model = _load(tiny_edit_dir)
    with torch.inference_mode():
        (job,) = nodes.QwenEditTrainLoRA().start(model, dataset, "skipping", 1, 1e-3, 4, "all", 1, 64, 0, False,
                                                 False)
    status = job.wait()
    assert status.state == "done", status.error
