"""Training logs every image it resizes to its bucket, with both sizes (and only those)."""

import logging
from pathlib import Path

import torch

from qwen_edit_core.data import example_tensors as et
from qwen_edit_core.data.examples import EditExample


def _example(name, target_size, control_sizes):
    return EditExample(name=name, target=Path(f"{name}.png"), controls=tuple(Path(f"{name}_c{i}.png")
                       for i in range(len(control_sizes))), caption="x", target_size=target_size,
                       control_sizes=tuple(control_sizes))


def _settings(control_size="pipeline"):
    return et.EncodeSettings(variant="edit", vae_area=64 * 64, vl_area=64 * 64, dtype=torch.float32,
                             control_size=control_size)


def test_each_resized_image_is_logged_with_its_size_and_bucket(caplog):
    examples = [_example("same", (64, 64), [(64, 64)]), _example("wide", (100, 50), [(64, 64)])]
    with caplog.at_level(logging.INFO, logger=et.__name__):
        n = et.log_resizes(examples, _settings())
    # 100x50 at a 64*64 area: sqrt(4096*2) = 90.5 -> 96 wide, 45.3 -> 32 high (diffusers' rounding to 32)
    lines = [r.getMessage() for r in caplog.records]
    assert n == 1
    assert any("wide target 100x50 to 96x32" in line for line in lines), lines
    assert not any("same" in line for line in lines)
    assert "1 image(s) of 2 examples" in lines[-1]


def test_target_control_size_logs_controls_at_the_targets_bucket(caplog):
    examples = [_example("pair", (64, 64), [(128, 64)])]
    with caplog.at_level(logging.INFO, logger=et.__name__):
        assert et.log_resizes(examples, _settings("target")) == 1
    assert any("pair control 0 128x64 to 64x64" in r.getMessage() for r in caplog.records)


def test_past_the_info_limit_lines_go_to_debug(caplog):
    examples = [_example(f"e{i}", (100, 50), []) for i in range(et.RESIZE_LINES_AT_INFO + 3)]
    with caplog.at_level(logging.DEBUG, logger=et.__name__):
        assert et.log_resizes(examples, _settings()) == et.RESIZE_LINES_AT_INFO + 3
    levels = [r.levelno for r in caplog.records if "training resizes e" in r.getMessage()]
    assert levels.count(logging.INFO) == et.RESIZE_LINES_AT_INFO and levels.count(logging.DEBUG) == 3
    assert "the rest at DEBUG" in caplog.records[-1].getMessage()
