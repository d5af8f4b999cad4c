"""What the shipped workflows' Notes say holds: each says once what to change first and repeats no sentence, only
workflows that train say what the toy learns, each states the time it took with the command that measured it,
and validation previews are labelled with the settings they run (steps and CFG)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from qwen_edit_core.config import load_config
from qwen_edit_core.train.validation import parse_previews, previews_from_config
from workflows.build_workflows import SECONDS, TIMED_BY

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((ROOT / "example_workflows").glob("*.json"))
TRAINS = {"QwenEditTrainLoRA", "QwenEditTrain"}


def _note(graph: dict) -> str:
    (note,) = [n["widgets_values"][0] for n in graph["nodes"] if n["type"] == "Note"]
    return note


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_note_says_each_thing_once_and_only_what_applies(path):
    graph = json.loads(path.read_text())
    note = _note(graph)
    assert note.lower().count("change first") == 1, f"{path.name}: 'Change first' {note.lower().count('change first')} times"
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", note) if s.strip()]
    assert len(sentences) == len(set(sentences)), f"{path.name}: a sentence is repeated"
    trains = any(n["type"] in TRAINS for n in graph["nodes"])
    assert trains == bool(re.search(r"\blearn", note)), f"{path.name}: says what the toy learns only if it trains"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_note_states_the_measured_time_and_its_command(path):
    note = _note(json.loads(path.read_text()))
    assert path.stem in SECONDS, f"{path.stem}: measure it with {TIMED_BY.format(name=path.stem)}"
    assert re.search(r"took \d+ (s|min) on a 2-core CPU", note), f"{path.name}: no measured time"
    assert TIMED_BY.format(name=path.stem) in note


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_validation_previews_are_labelled_with_their_steps_and_cfg(path):
    """A preview's label is the one the trainer makes (schedule, steps, CFG), never a hand-written one that may
    not match what it runs."""
    graph = json.loads(path.read_text())
    for node in graph["nodes"]:
        if node["type"] != "QwenEditTrainOptions":
            continue
        text = next(v for v in node["widgets_values"] if isinstance(v, str) and "steps=" in v)
        items = parse_previews(text.splitlines())
        assert all("label" not in item for item in items), f"{path.name}: a hand-written label"
        config = load_config(overrides={"train": {"validation_previews": items}})
        for preview, item in zip(previews_from_config(config), items):
            assert preview.label.endswith(f"{preview.settings.num_inference_steps} steps, CFG "
                                          f"{preview.settings.true_cfg_scale:g}"), preview.label
            assert preview.settings.true_cfg_scale == 1.0, f"{path.name}: the toy runs at CFG 1 ({preview.label})"


def test_a_default_label_names_its_cfg():
    config = load_config(overrides={"predict": {"true_cfg_scale": 4.0},
                                    "train": {"validation_previews": [{"schedule": "diffusers"}]}})
    (preview,) = previews_from_config(config)
    assert preview.label == "diffusers 8 steps, CFG 4"
