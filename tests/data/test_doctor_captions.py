"""The dataset doctor's captions against the text encoder's tokenizer, found without downloading anything: the
model directory given with --model (here the tiny model's tokenizer), or a training --config's model; a caption
over the encoder's 1,024 tokens and one with no instruction for the template's slot are flagged, and without a
tokenizer the report says the lengths were not checked. A --config also shares the training run's cache."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from qwen_edit_core import cli
from qwen_edit_core.api import doctor_dataset
from qwen_edit_core.data.doctor import runner
from qwen_edit_core.data.doctor.captions import NO_TOKENIZER
from qwen_edit_core.data.doctor.faulty import write_faulty_dataset
from qwen_edit_core.families.templates import MAX_SEQUENCE_LENGTH
from qwen_edit_core.model.components import token_counter


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    faulty = write_faulty_dataset(tmp_path_factory.mktemp("captions") / "faulty")
    (faulty.train / "pair002.txt").write_text(" ".join(f"w{i}" for i in range(MAX_SEQUENCE_LENGTH + 20)))
    (faulty.train / "pair007.txt").write_text("12345")  # a generator's seed, no instruction
    return faulty.train


def test_the_models_tokenizer_flags_a_caption_too_long_and_one_without_instruction(folder, tiny_plus_dir,
                                                                                  tmp_path, capsys):
    code = cli.main(["doctor", str(folder), "--model", str(tiny_plus_dir), "--json", "--out", str(tmp_path)])
    found = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    captions = {(f["pair"], f["fix"]): f["figure"] for f in found if f["kind"] == "caption"}
    tokens = token_counter(tiny_plus_dir / "processor")((folder / "pair002.txt").read_text())
    assert code == 0 and tokens > MAX_SEQUENCE_LENGTH
    assert captions[("pair002", f"shorten it to at most {MAX_SEQUENCE_LENGTH} tokens")] == tokens
    assert captions[("pair007", "write the edit instruction")] == "12345"
    assert not {pair for pair, _ in captions} - {"pair002", "pair007"}


def test_without_a_tokenizer_the_report_says_the_lengths_were_not_checked(folder, tiny_plus_dir, tmp_path):
    bare = doctor_dataset(folder).report
    assert NO_TOKENIZER in bare.notes and "caption_tokens" not in bare.stats
    # the empty instruction needs no tokenizer; the long caption is only far longer than the others
    assert {(f.pair, f.fix) for f in bare.of_kind("caption")} == {("pair007", "write the edit instruction"),
                                                                  ("pair002", None)}
    counted = doctor_dataset(folder, model=tiny_plus_dir).report
    assert NO_TOKENIZER not in counted.notes and counted.stats["caption_tokens"]["limit"] == MAX_SEQUENCE_LENGTH


def test_a_training_config_gives_the_tokenizer_and_the_cache_the_training_run_reuses(folder, tiny_plus_dir,
                                                                                   tmp_path, monkeypatch, caplog):
    from qwen_edit_core.config import load_config
    from qwen_edit_core.train import run
    data = tmp_path / "data"
    shutil.copytree(folder, data)
    (data / "pair002.txt").write_text("invert the colors")  # the training reader refuses a caption too long
    config_file = tmp_path / "train.yaml"
    config_file.write_text(yaml.safe_dump({
        "model": {"pretrained_model_name_or_path": str(tiny_plus_dir)}, "data": {"folder": str(data)},
        "cache": {"dir": str(tmp_path / "cache")}, "train": {"output_dir": str(tmp_path / "o")}}))
    with caplog.at_level("INFO", logger="qwen_edit_core.cli"):
        assert cli.main(["doctor", "--config", str(config_file), "--out", str(tmp_path / "report")]) == 0
    assert "caption tokens: median" in caplog.text and NO_TOKENIZER not in caplog.text
    assert (tmp_path / "cache" / runner.CACHE_FILE).is_file()
    config = load_config(config_file)
    monkeypatch.setattr(runner, "measure", lambda pair: pytest.fail(f"{pair.example.name} measured again"))
    measured = run.doctor_measurer(config)
    report = run.run_doctor(config, run.load_examples(config, measured).examples, [], measured)
    assert report.pairs == 24 and [f.pair for f in report.of_kind("caption")] == ["pair007"]
