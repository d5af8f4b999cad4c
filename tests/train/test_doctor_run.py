"""The dataset doctor before a training run's first step (`data.doctor`): its summary in the log ("warn", the
default), the run refused before any weight loads ("refuse"), nothing at all ("off")."""

from __future__ import annotations

import logging

import pytest

from qwen_edit_core import QwenImageEditTrainer
from qwen_edit_core.data.doctor.faulty import write_faulty_dataset
from qwen_edit_core.model import components
from qwen_edit_core.train import run

from conftest import train_config


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    return write_faulty_dataset(tmp_path_factory.mktemp("doctor-run") / "faulty")


def test_the_training_log_shows_the_doctors_summary(tiny_plus_dir, faulty, tmp_path, caplog):
    config = train_config(tiny_plus_dir, faulty.train, tmp_path / "o", train={"max_steps": 1})
    with caplog.at_level(logging.INFO, logger="qwen_edit_core.train.run"):
        result = QwenImageEditTrainer(config).fit()
    assert result.state == "done"
    summary = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("dataset doctor:"))
    assert "24 pair(s), 12 flagged" in summary and "3 swapped" in summary and "pair013: reference-order" in summary
    assert (tmp_path / "o" / "cache" / "doctor-measures.json").is_file()


def test_refuse_stops_the_run_before_any_weight_loads(tiny_plus_dir, faulty, tmp_path, monkeypatch):
    config = train_config(tiny_plus_dir, faulty.train, tmp_path / "o", data={"doctor": "refuse"})
    monkeypatch.setattr(components, "load_components", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ValueError, match=r"(?s)dataset doctor: 24 pair\(s\).*data.doctor is 'refuse'"):
        QwenImageEditTrainer(config).fit()


def test_off_skips_it(tiny_plus_dir, faulty, tmp_path):
    config = train_config(tiny_plus_dir, faulty.train, tmp_path / "o", data={"doctor": "off"})
    assert run.run_doctor(config, [], []) is None


def test_data_pixel_aligned_lets_the_fixes_realign(tiny_plus_dir, faulty, tmp_path):
    from qwen_edit_core.data.dataset import load_dataset
    examples = load_dataset(faulty.train).examples
    fixes = {}
    for data in ({}, {"pixel_aligned": True}, {"control_size": "target"}):
        config = train_config(tiny_plus_dir, faulty.train, tmp_path / "o", data=data)
        fixes[str(data)] = {f.fix.split(" ")[0] for f in run.run_doctor(config, examples, []).of_kind("misaligned")}
    assert fixes == {"{}": {"re-export"}, "{'pixel_aligned': True}": {"realign"},
                     "{'control_size': 'target'}": {"realign"}}


def test_the_train_command_sets_data_pixel_aligned():
    from qwen_edit_core.cli import build_parser, train_overrides
    assert train_overrides(build_parser().parse_args(["train", "c.yaml", "--pixel-aligned"])) == {
        "data": {"pixel_aligned": True}}


def test_the_run_measures_from_the_readers_decode_and_a_second_run_from_the_cache(tiny_plus_dir, faulty, tmp_path,
                                                                                 monkeypatch):
    from PIL import Image

    from qwen_edit_core.data.doctor import runner
    config = train_config(tiny_plus_dir, faulty.train, tmp_path / "o")
    opened, real_open = [], Image.open
    monkeypatch.setattr(Image, "open", lambda fp, *a, **k: opened.append(fp) or real_open(fp, *a, **k))
    measured = run.doctor_measurer(config)
    first = run.run_doctor(config, run.load_examples(config, measured).examples, [], measured)
    assert len(opened) == len([p for p in faulty.train.iterdir() if p.suffix == ".png"])  # one decode each
    monkeypatch.setattr(runner, "measure", lambda pair: pytest.fail(f"{pair.example.name} measured again"))
    measured = run.doctor_measurer(config)
    assert run.run_doctor(config, run.load_examples(config, measured).examples, [], measured) == first
