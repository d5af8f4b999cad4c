"""What "auto" attention picks: the first offered kernel of its GPU's FASTEST_FIRST row, torch's own order
elsewhere; and the row the runbook's timings give."""

from __future__ import annotations

import contextlib

import torch

from qwen_edit_core import speed
from qwen_edit_core.bench.attention import fastest_first, time_kernels
from qwen_edit_core.speed.attention import FASTEST_FIRST, auto_kernel


def test_auto_takes_the_first_offered_kernel_of_its_gpus_row():
    assert auto_kernel((9, 0), ("flash3", "cudnn", "flash", "efficient", "math")) == "cudnn"
    assert auto_kernel((9, 0), ("flash", "efficient", "math")) == "flash"  # a build without cuDNN attention
    assert auto_kernel((9, 0), ("math",)) == "auto"  # none of the row's kernels: torch's own order
    assert auto_kernel((8, 6), ("cudnn", "flash", "efficient", "math")) == "auto"  # no row: torch's own order
    assert auto_kernel(None, ("math",)) == "auto"


def test_every_row_names_sdpa_kernels_that_fall_back_and_its_source():
    for capability, (order, source) in FASTEST_FIRST.items():
        assert len(capability) == 2 and order and source.strip()
        assert set(order) <= set(speed.SDPA_KERNELS) - {"auto", "math"}, order  # flash3 cannot fall back


def test_the_runbook_timings_give_a_row_fastest_first():
    timings = {"flash3": 0.004, "cudnn": 0.011, "flash": 0.009, "efficient": None, "math": 0.2}
    assert fastest_first(timings) == ("flash", "cudnn")  # failed, math and non-SDPA kernels left out


def test_auto_without_a_cuda_device_keeps_torchs_order():
    assert isinstance(speed.attention_kernel("auto", "cpu"), contextlib.nullcontext)
    assert isinstance(speed.attention_kernel("auto"), contextlib.nullcontext)


def test_the_kernel_timings_run_on_the_cpu():
    timings = time_kernels(torch.device("cpu"), repeats=1, tokens=32)
    assert set(timings) == {"math"} and timings["math"] is not None and timings["math"] > 0
