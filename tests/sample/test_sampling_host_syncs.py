"""No host read of device values (a GPU sync each) inside a sampling step; node previews are throttled."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from host_reads import HostReads
from qwen_edit_core.model.components import load_components
from qwen_edit_core.model.devices import DevicePlan
from qwen_edit_core.sample import sampler
from qwen_edit_core.sample.batch import sample_batch


@pytest.fixture(scope="module")
def comps(tiny_edit_dir):
    return load_components(tiny_edit_dir, DevicePlan.from_mapping({}))


def _image():
    return Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))


@pytest.mark.parametrize("cfg_mode", ["sequential", "batched"])
def test_a_sampling_step_reads_nothing_from_the_device(comps, cfg_mode):
    """Between two progress events (one whole Euler step: cond and uncond calls, CFG, scheduler) nothing is
    read on the host; cond and uncond differ in length, so the text mask is in play."""
    settings = sampler.SampleSettings(num_inference_steps=4, seed=3, width=128, height=128, vae_area=128 * 128,
                                      cfg_mode=cfg_mode, negative_prompt="a much longer negative prompt than that")
    cond = sampler.build_conditioning(comps, "x", [_image()], settings)
    assert cond.cond.embeds.shape[1] != cond.uncond.embeds.shape[1]
    mode, per_step = HostReads(), []

    def progress(event):
        per_step.append(list(mode.where))
        mode.where.clear()

    with mode:
        sampler.denoise(comps, cond, settings, progress=progress)
    assert len(per_step) == 4
    assert per_step[1:] == [[], [], []], per_step


def test_sample_batch_steps_read_nothing_from_the_device(comps):
    settings = sampler.SampleSettings(num_inference_steps=3, seed=3, vae_area=64 * 64)
    mode, per_step = HostReads(), []

    def progress(event):
        per_step.append(list(mode.where))
        mode.where.clear()

    with mode:
        sample_batch(comps, ["a", "a longer prompt"], [[_image()], [_image()]], settings, progress=progress)
    assert per_step[1:] == [[], []], per_step


def test_node_previews_are_throttled():
    from nodes.sample_nodes import PREVIEWS, preview_due
    for total in (1, 4, 8, 20, 50):
        due = [s for s in range(1, total + 1) if preview_due(s, total)]
        assert due[-1] == total and len(due) <= PREVIEWS + 1
    assert [s for s in range(1, 21) if preview_due(s, 20)] == [3, 6, 9, 12, 15, 18, 20]
