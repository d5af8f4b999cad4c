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


@pytest.mark.parametrize("name", ["../../escaped_lora", "/tmp/abs_lora", "sub/lora", "..", "a\\b", "c:lora",
                                  ".hidden", "line\nbreak", ""])
def test_a_lora_name_that_would_leave_the_output_folder_is_refused_at_load(tmp_path, name):
    with pytest.raises(ConfigError, match=r"train\.lora_name: .* give a plain file name"):
        load_config(overrides={"train": {"lora_name": name}})


def test_one_file_name_rule_for_lora_names_job_names_and_pair_prefixes(tmp_path):
    from qwen_edit_core.common.names import file_name_problem
    from qwen_edit_core.data.pair_writer import check_prefix
    from qwen_edit_core.jobs import JobRegistry
    bad = "../escaped"
    assert file_name_problem(bad)
    with pytest.raises(ValueError, match=r"name prefix '../escaped' holds a folder separator"):
        check_prefix(bad)
    with pytest.raises(ValueError, match=r"job name '../escaped' holds a folder separator"):
        JobRegistry().start(load_config(), name=bad)
    assert file_name_problem("my_lora-v2 final") is None
    assert file_name_problem("é" * 100) is None and "longer than 200 bytes" in file_name_problem("é" * 100 + "x")
    with pytest.raises(ConfigError, match=r"train\.lora_name: 'x{20}.* is longer than 200 bytes"):
        load_config(overrides={"train": {"lora_name": "x" * 201}})


def test_a_preview_label_is_one_line_of_text(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.validation_previews\[0\]\.label: .* one line"):
        load_config(overrides={"train": {"validation_previews": [{"label": "two\nlines"}]}})
    with pytest.raises(ConfigError, match=r"label: .* is longer than 200 characters"):
        load_config(overrides={"train": {"validation_previews": [{"label": "x" * 201}]}})
    assert load_config(overrides={"train": {"validation_previews": [{"label": "x" * 200}]}})


def _alias_bomb(levels: int) -> str:
    """model.lora.targets holding `levels` nested lists of 9 aliases each (9**levels strings once expanded)."""
    lines = ["model:", "  lora:", "    targets:", "      - &l0 [to_q, to_q, to_q, to_q, to_q, to_q, to_q, to_q, to_q]"]
    for i in range(1, levels + 1):
        lines.append(f"      - &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path):
    with pytest.raises(ConfigError, match=r"is refused: the document expands to more than 100000 values through "
                                          r"its aliases"):
        _load(tmp_path, _alias_bomb(9))  # 9**9 = 387 million strings once expanded
    with pytest.raises(ConfigError, match="an alias refers to its own anchor"):
        _load(tmp_path, "model:\n  lora:\n    targets: &a [to_q, *a]\n")


def test_lora_targets_are_a_string_or_a_list_of_strings(tmp_path):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, _alias_bomb(3))  # 6,561 strings: under the bound, but lists inside the list
    message = str(err.value)
    assert "model.lora.targets[0]: expected a string, got ['to_q'" in message and len(message) < 2000
    assert _load(tmp_path, "model:\n  lora:\n    targets: [to_q, to_k]\n").model.lora.targets == ("to_q", "to_k")


def test_an_unknown_enum_value_does_not_hide_the_other_bad_values(tmp_path):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, "optimizer:\n  type: adam\n  lr: 0\ntrain:\n  max_steps: -5\n  lerning_rate: 1\n"
                        "  lora_name: ../x\ndata:\n  batch_size: two\n")
    message = str(err.value)
    for expected in ("optimizer.type: 'adam' is not accepted; accepted: adamw, adamw8bit", "optimizer.lr: 0.0 must "
                     "be > 0", "train.max_steps: -5 must be >= 1", "unknown config key 'train.lerning_rate'",
                     "train.lora_name", "data.batch_size: expected an integer, got 'two'"):
        assert expected in message
    with pytest.raises(ConfigError) as err:  # a value named for its type is not named again for its range
        _load(tmp_path, "optimizer:\n  betas: [a, 0.9]\n")
    assert str(err.value) == "optimizer.betas[0]: expected a number, got 'a'"
