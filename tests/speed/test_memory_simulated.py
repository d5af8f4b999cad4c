"""The memory planner's promise, checked at real size on the CPU: the simulated training step of the 16 GiB
plan (1024^2 Edit, the real 60-block transformer, real token counts, the product's levers, LoRA and AdamW
under FakeTensorMode; bench/memory.py) holds at most 16 GiB on the device, margin included, and the
planner's estimate is within 15% of it."""

from __future__ import annotations

import pytest

from qwen_edit_core.bench import memory


@pytest.fixture(scope="module")
def plan_16():
    return memory.simulate_train("edit", 1024, budget_gb=16)


def test_16_gib_plan_fits_16_gib_at_real_size(plan_16):
    assert plan_16.image_tokens == 8192 and plan_16.text_tokens > 1400  # the real sequence, not a shrunk one
    assert plan_16.peak_device_gib <= 16.0, memory.table([plan_16])


def test_planner_estimate_is_within_15_percent_of_the_simulated_peak(plan_16):
    assert abs(plan_16.planner_estimate_gib - plan_16.peak_device_gib) <= 0.15 * plan_16.peak_device_gib, \
        memory.table([plan_16])


def test_offloaded_weights_leave_the_device_after_the_step(plan_16):
    assert plan_16.offloaded_resident_after_gib == 0.0, memory.table([plan_16])
