"""The dataset doctor's optional vision-language check, on the tiny model's text encoder: plumbing only (the tiny
model's answers are noise). The prompt carries both pictures, the model answers, and each pair ends up either
judged or counted as unclear; "yes"/"no" are read from the answer's first word; `qwen-edit doctor --vlm` loads the
model's text encoder from its local files and asks it."""

from __future__ import annotations

import json
import logging
import re
from types import SimpleNamespace

import pytest
import torch

from qwen_edit_core import cli
from qwen_edit_core.data.dataset import DatasetError, load_dataset
from qwen_edit_core.data.synthetic import DEMO_EDIT, write_pairs
from qwen_edit_core.data.doctor import diagnose, vlm
from qwen_edit_core.data.doctor.faulty import write_faulty_dataset
from qwen_edit_core.data.doctor.findings import PROPOSED_CAPTION, Measured
from qwen_edit_core.model.components import load_text_encoder


@pytest.fixture(scope="module")
def encoder(tiny_plus_dir):
    return load_text_encoder(tiny_plus_dir, device=torch.device("cpu"), dtype=torch.float32)


def test_the_answer_is_read_from_its_first_word():
    assert [vlm.verdict(a) for a in ("Yes.", " no, it is not", "Maybe", "")] == [True, False, None, None]


def test_the_tiny_text_encoder_answers_about_both_pictures(encoder, tmp_path):
    faulty = write_faulty_dataset(tmp_path / "faulty")
    examples = load_dataset(faulty.train).examples[:2]
    answer = vlm.ask(encoder, [vlm.full_rgb(examples[0].controls[0]), vlm.full_rgb(examples[0].target)],
                     vlm.QUESTION.format(examples[0].caption), max_new_tokens=3)
    assert isinstance(answer, str)
    result = vlm.check([Measured(e.name, e, SimpleNamespace(source=0)) for e in examples], encoder)
    asked, yes, no, neither = map(int, re.search(r"(\d+) pair\(s\) asked, (\d+) yes, (\d+) no, (\d+) neither",
                                                  result.notes[0]).groups())
    assert asked == yes + no + neither == 2 and no == len(result.findings)
    assert all(f.kind == "caption" for f in result.findings)
    report = diagnose(examples, (), text_encoder=encoder)
    assert set(report.notes) >= set(result.notes)  # the same greedy answers through the doctor


def test_the_command_asks_the_models_text_encoder_with_vlm(tiny_plus_dir, tmp_path, caplog, capsys):
    write_pairs(tmp_path / "pairs", 2, 0, DEMO_EDIT[0], 64)
    with caplog.at_level(logging.INFO, logger="qwen_edit_core.cli"):
        assert cli.main(["doctor", str(tmp_path / "pairs"), "--model", str(tiny_plus_dir), "--vlm",
                         "--out", str(tmp_path / "report")]) == 0
    assert "note: vision-language check: 2 pair(s) asked" in caplog.text
    assert cli.main(["doctor", str(tmp_path / "pairs"), "--vlm", "--out", str(tmp_path / "report")]) == 2
    assert "the vision-language check needs the model's text encoder" in capsys.readouterr().err


def test_a_pair_without_a_caption_gets_a_proposal_that_fix_writes(tiny_plus_dir, tmp_path, capsys):
    write_pairs(tmp_path / "pairs", 3, 0, DEMO_EDIT[0], 64)
    (tmp_path / "pairs" / "pair001.txt").unlink()
    (tmp_path / "pairs" / "pair002.txt").write_text(" \n", encoding="utf-8")
    with pytest.raises(DatasetError, match="caption file is missing"):
        load_dataset(tmp_path / "pairs")  # what training accepts is unchanged
    assert cli.main(["doctor", str(tmp_path / "pairs"), "--json", "--out", str(tmp_path / "plain")]) == 0
    plain = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert not {"pair001", "pair002"} & {f["pair"] for f in plain}  # without --vlm they are skipped, as before
    assert cli.main(["doctor", str(tmp_path / "pairs"), "--model", str(tiny_plus_dir), "--vlm", "--json",
                     "--out", str(tmp_path / "report"), "--fix", str(tmp_path / "fixed")]) == 0
    findings = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    proposed = {f["pair"]: f for f in findings if f["kind"] == "caption" and "machine-proposed" in f["why"]}
    assert set(proposed) == {"pair001", "pair002"}
    for name, finding in proposed.items():
        assert finding["fix"].startswith(PROPOSED_CAPTION) and finding["fix"] != PROPOSED_CAPTION
        written = (tmp_path / "fixed" / f"{name}.txt").read_text(encoding="utf-8")
        assert written == finding["fix"][len(PROPOSED_CAPTION):] + "\n"
    assert not (tmp_path / "pairs" / "pair001.txt").exists()  # the original is never changed
    assert (tmp_path / "pairs" / "pair002.txt").read_text(encoding="utf-8") == " \n"
