"""Dataset Doctor node: the flagged pairs of the planted-fault dataset as one picture (a row per pair: control,
target, difference, finding) and the summary; the fixed copy where asked."""

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
