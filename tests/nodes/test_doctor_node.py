"""Dataset Doctor node: the flagged pairs of the planted-fault dataset as one picture (a row per pair: control,
target, difference, finding) and the summary; the fixed copy where asked; a connected text encoder asked about each
pair (plumbing, on the tiny model)."""

from __future__ import annotations

import nodes
from nodes.common import DatasetHandle
from qwen_edit_core.data.dataset import load_dataset
from qwen_edit_core.data.doctor.faulty import write_faulty_dataset
from qwen_edit_core.data.doctor.look import CELL


def test_the_node_shows_the_flagged_pairs_and_writes_the_fixed_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("QWEN_EDIT_OUTPUT", str(tmp_path / "output"))
    faulty = write_faulty_dataset(tmp_path / "faulty")
    handle = DatasetHandle(faulty.train, load_dataset(faulty.train))
    out = nodes.QwenEditDatasetDoctor().check(handle, True, str(faulty.heldout), str(tmp_path / "fixed"))
    image, summary = out["result"]
    assert summary.startswith("dataset doctor: 24 pair(s) and 2 held-out pair(s), 13 flagged")
    assert "12 fix(es) applied" in summary and (tmp_path / "fixed" / "pair001.png").is_file()
    assert image.shape[0] == 1 and image.shape[1] == 12 * CELL and image.shape[3] == 3  # the 12 worst of 13
    assert (tmp_path / "output" / "qwen_edit_doctor" / "train" / "report.png").is_file()


def test_a_connected_text_encoder_is_asked_about_each_pair(tiny_plus_dir, tmp_path, monkeypatch):
    import torch

    from qwen_edit_core.data.synthetic import DEMO_EDIT, write_pairs
    from qwen_edit_core.model.components import load_text_encoder
    monkeypatch.setenv("QWEN_EDIT_OUTPUT", str(tmp_path / "output"))
    optional = list(nodes.QwenEditDatasetDoctor.INPUT_TYPES()["optional"])
    assert optional[-1] == "text_encoder"  # the input added last
    write_pairs(tmp_path / "pairs", 2, 0, DEMO_EDIT[0], 64)
    encoder = load_text_encoder(tiny_plus_dir, device=torch.device("cpu"), dtype=torch.float32)
    handle = DatasetHandle(tmp_path / "pairs", load_dataset(tmp_path / "pairs"))
    _, summary = nodes.QwenEditDatasetDoctor().check(handle, False, text_encoder=encoder)["result"]
    assert "note: vision-language check: 2 pair(s) asked" in summary


def _pairs_handle(folder):
    from qwen_edit_core.data.synthetic import DEMO_EDIT, write_pairs
    write_pairs(folder, 2, 0, DEMO_EDIT[0], 64)
    return DatasetHandle(folder, load_dataset(folder))


def test_an_unloaded_text_encoder_is_refused_with_what_to_do(tmp_path, monkeypatch):
    """An encoder emptied by its loader (or ComfyUI's unload) is refused before the doctor runs on meta weights."""
    import pytest
    import torch

    from qwen_edit_core.model.components import TextEncoder
    monkeypatch.setenv("QWEN_EDIT_OUTPUT", str(tmp_path / "output"))
    emptied = TextEncoder(torch.nn.Linear(2, 2).to("meta"), processor=None, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="this model was unloaded"):
        nodes.QwenEditDatasetDoctor().check(_pairs_handle(tmp_path / "pairs"), False, text_encoder=emptied)


def test_a_text_encoder_a_training_job_uses_is_refused_naming_the_job(tmp_path, monkeypatch):
    import pytest
    import torch

    from conftest import held_training_job
    from qwen_edit_core import jobs
    from qwen_edit_core.model.components import TextEncoder
    monkeypatch.setenv("QWEN_EDIT_OUTPUT", str(tmp_path / "output"))
    encoder = TextEncoder(torch.nn.Linear(2, 2), processor=None, device=torch.device("cpu"))
    with held_training_job(monkeypatch, encoder.model, tmp_path / "run"):
        with pytest.raises(jobs.JobBusyError, match="training job 'lora' trains on this model.*cannot check a dataset"):
            nodes.QwenEditDatasetDoctor().check(_pairs_handle(tmp_path / "pairs"), False, text_encoder=encoder)
