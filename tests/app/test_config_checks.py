"""The config reads like people write it and refuses out-of-range values at load, by dotted key path."""

from __future__ import annotations

import logging

import pytest

from qwen_edit_core import load_config
from qwen_edit_core.config import ConfigError


def _load(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_config(path)


@pytest.mark.parametrize("text, value", [("1e-3", 1e-3), ("3E-5", 3e-5), ("1.5e-4", 1.5e-4), (".5", 0.5),
                                         ("2e+1", 20.0), ("1", 1.0)])
def test_scientific_notation_is_a_number(tmp_path, text, value):
    assert _load(tmp_path, f"optimizer:\n  lr: {text}\n").optimizer.lr == value


def test_quoted_numbers_stay_strings_and_integers_stay_integers(tmp_path):
    with pytest.raises(ConfigError, match=r"optimizer\.lr: expected a number"):
        _load(tmp_path, "optimizer:\n  lr: '1e-3'\n")
    config = _load(tmp_path, "train:\n  max_steps: 200\n")
    assert config.train.max_steps == 200 and isinstance(config.train.max_steps, int)
    with pytest.raises(ConfigError, match=r"train\.max_steps: expected an integer"):
        _load(tmp_path, "train:\n  max_steps: 1e3\n")


@pytest.mark.parametrize("text, path", [
    ("train:\n  max_steps: -5\n", r"train\.max_steps: -5 must be >= 1"),
    ("train:\n  max_steps: 0\n", r"train\.max_steps: 0 must be >= 1"),
    ("optimizer:\n  lr: 0\n", r"optimizer\.lr: 0.0 must be > 0"),
    ("optimizer:\n  lr: -1e-4\n", r"optimizer\.lr"),
    ("optimizer:\n  betas: [0.9, 1.5]\n", r"optimizer\.betas"),
    ("data:\n  batch_size: 0\n", r"data\.batch_size"),
    ("data:\n  caption_dropout_rate: 1.5\n", r"data\.caption_dropout_rate"),
    ("data:\n  vae_area: 100\n", r"data\.vae_area"),
    ("model:\n  lora:\n    rank: 0\n", r"model\.lora\.rank"),
    ("predict:\n  num_inference_steps: 0\n", r"predict\.num_inference_steps"),
    ("train:\n  gradient_accumulation_steps: 0\n", r"train\.gradient_accumulation_steps"),
    ("optimizer:\n  lr: .nan\n", r"optimizer\.lr: expected a finite number"),
    ("train:\n  skip_nonfinite_steps: -1\n", r"train\.skip_nonfinite_steps"),
])
def test_out_of_range_values_fail_at_load_naming_the_key(tmp_path, text, path):
    with pytest.raises(ConfigError, match=path):
        _load(tmp_path, text)


def test_every_bad_value_is_named_at_once(tmp_path):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, "train:\n  max_steps: -5\noptimizer:\n  lr: 0\n")
    assert "train.max_steps" in str(err.value) and "optimizer.lr" in str(err.value)


@pytest.mark.parametrize("text, path", [
    ("data:\n  bucket_grouping: similr\n", r"data\.bucket_grouping"),
    ("train:\n  mixed_precision: bf17\n", r"train\.mixed_precision"),
    ("train:\n  timestep_sampling: logit-normal\n", r"train\.timestep_sampling"),
    ("optimizer:\n  type: adam\n", r"optimizer\.type"),
    ("lr_scheduler:\n  type: cosin\n", r"lr_scheduler\.type"),
    ("predict:\n  cfg_mode: both\n", r"predict\.cfg_mode"),
    ("model:\n  quantize: int4\n", r"model\.quantize"),
])
def test_enum_fields_fail_at_load(tmp_path, text, path):
    with pytest.raises(ConfigError, match=path + r".*accepted"):
        _load(tmp_path, text)


def test_warmup_longer_than_the_run_warns(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="qwen_edit_core.config"):
        _load(tmp_path, "train:\n  max_steps: 10\nlr_scheduler:\n  warmup_steps: 50\n")
    assert "warmup_steps 50" in caplog.text
