"""The tests' float32 tolerances (tests/tolerances.py) pass rounding-level differences and fail real bugs."""

from __future__ import annotations

import pytest
import torch

from tolerances import (ADAM_GRADIENT_RANGE, FP32_U, TINY_FORWARD_ROUNDINGS, adam_trained_size, assert_close_fp32,
                        fp32_tolerance, tiny_sampler_roundings, tiny_training_roundings)


def test_the_tolerance_is_rounding_steps_times_unit_roundoff_times_size():
    reference = torch.tensor([0.5, -4.0, 2.0])
    assert fp32_tolerance(reference, ops=8) == 2 * 8 * 2.0 ** -24 * 4.0
    assert FP32_U == 2.0 ** -24
    assert tiny_sampler_roundings(3) == 3 * TINY_FORWARD_ROUNDINGS + 32
    assert tiny_training_roundings(2) == 2 * 3 * TINY_FORWARD_ROUNDINGS  # forward and backward, per step
    with pytest.raises(ValueError, match="ops=0"):
        fp32_tolerance(reference, ops=0)


def test_summation_order_passes_and_real_bugs_fail_naming_what_differed():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 256, generator=g), torch.randn(256, 32, generator=g)
    expected = a @ b
    reordered = (a[:, :128] @ b[:128] + a[:, 128:] @ b[128:])  # the same sums in another order
    assert_close_fp32(reordered, expected, ops=256, what="split matmul")
    for bug in (expected * 1.01, expected - a[:, :1] @ b[:1], expected[:, torch.randperm(32, generator=g)]):
        with pytest.raises(AssertionError, match=r"buggy matmul: max \|difference\| .* > allowed"):
            assert_close_fp32(bug, expected, ops=256, what="buggy matmul")  # a wrong scale, term, layout


def test_state_dicts_compare_key_by_key_against_each_keys_size():
    small, large = torch.full((3,), 1e-3), torch.full((3,), 1e3)
    bumped = large + 1e-4  # two units in the last place of 1e3
    assert not torch.equal(bumped, large)
    assert_close_fp32({"s": small, "l": bumped}, {"s": small, "l": large}, ops=2, what="state")
    with pytest.raises(AssertionError, match=r"state \[s\]"):  # 1e-4 is rounding for 1e3, not for 1e-3
        assert_close_fp32({"s": small + 1e-4, "l": large}, {"s": small, "l": large}, ops=2, what="state")


def test_an_adam_trained_lora_is_as_large_as_its_weights_plus_a_magnified_step():
    state = {"down": torch.tensor([0.5, -0.25]), "up": torch.zeros(2)}
    assert adam_trained_size(state, lr=1e-3) == {"down": 0.5 + ADAM_GRADIENT_RANGE * 1e-3,
                                                 "up": ADAM_GRADIENT_RANGE * 1e-3}
    moved = {"down": state["down"], "up": torch.tensor([1e-3, 0.0])}  # a whole Adam step: not rounding
    with pytest.raises(AssertionError, match=r"LoRA \[up\]"):
        assert_close_fp32(moved, state, ops=tiny_training_roundings(3), size=adam_trained_size(state, lr=1e-3),
                          what="LoRA")
