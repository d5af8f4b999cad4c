"""The dataset doctor's optional vision-language check, on the tiny model's text encoder: plumbing only (the tiny
model's answers are noise). The prompt carries both pictures, the model answers, and each pair ends up either
judged or counted as unclear; "yes"/"no" are read from the answer's first word."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qwen_edit_core.data.dataset import load_dataset
from qwen_edit_core.data.doctor import diagnose, vlm
from qwen_edit_core.data.doctor.faulty import write_faulty_dataset
from qwen_edit_core.data.doctor.findings import Measured
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
    judged = {f.pair for f in result.findings}
    unclear = int(result.notes[0].split(" of ")[0].split()[-1]) if result.notes else 0
    assert len(judged) + unclear == 2 and all(f.kind == "caption" for f in result.findings)
    report = diagnose(examples, (), text_encoder=encoder)
    assert set(report.notes) >= set(result.notes)  # the same greedy answers through the doctor
