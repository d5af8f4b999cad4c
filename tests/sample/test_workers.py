"""The transformer in a pool of worker processes (context-parallel over 2 CPU workers, gloo): the sampler's
image through the pool equals the in-process one, the pool starts once, is reused and closes when its transformer
is dropped, a worker's error closes it, workers exit cleanly; fewer than two devices are refused naming the count."""

from __future__ import annotations

import copy
import dataclasses
import gc

import numpy as np
import pytest
import torch
from PIL import Image

from qwen_edit_core.model.components import load_components
from qwen_edit_core.model.devices import DevicePlan
from qwen_edit_core.sample import sampler, workers

from tolerances import TINY_FORWARD_ROUNDINGS, assert_close_fp32

SETTINGS = sampler.SampleSettings(num_inference_steps=2, true_cfg_scale=4.0, seed=3, vae_area=96 * 64,
                                  cfg_mode="batched")
PROMPT = "make the square blue and the background a little darker"  # an odd prompt token count


@pytest.fixture(scope="module")
def comps(tiny_edit_dir):
    return load_components(tiny_edit_dir, DevicePlan.from_mapping({}))


def _control() -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8))  # 24 image tokens: an uneven split


@pytest.mark.slow  # worker processes
def test_pool_equals_the_in_process_sampler_is_started_once_and_goes_with_its_transformer(comps):
    cond = sampler.build_conditioning(comps, PROMPT, [_control()], SETTINGS)
    reference = sampler.denoise(comps, cond, SETTINGS)
    transformer = copy.deepcopy(comps.transformer)  # one this test can drop
    try:
        pool = workers.shared_pool(transformer, ["cpu", "cpu"])
        pids = list(pool.pids)
        assert len(set(pids)) == 2 and all(p.poll() is None for p in pool.processes)
        remote = dataclasses.replace(comps, transformer=pool)
        first = sampler.denoise(remote, cond, SETTINGS)
        again = workers.shared_pool(transformer, ["cpu", "cpu"])
        second = sampler.denoise(dataclasses.replace(comps, transformer=again), cond, SETTINGS)
        assert again is pool and again.pids == pids  # the same worker processes served both calls
        # the workers split the tokens, so their matmuls and attention sum in another order: the latents (no
        # VAE) differ by the rounding of one transformer forward per step
        ops = SETTINGS.num_inference_steps * TINY_FORWARD_ROUNDINGS
        assert_close_fp32(first, reference, ops=ops, what="latents through the pool vs in process")
        assert_close_fp32(second, reference, ops=ops, what="latents through the reused pool vs in process")
        del transformer  # the workers' copies of it go with it
        gc.collect()
        assert pool.closed, "the pool outlived its transformer"
    finally:
        workers.close_pools()
    assert all(p.returncode == 0 for p in pool.processes)  # stopped cleanly, none left running


@pytest.mark.slow  # worker processes
def test_a_worker_error_closes_the_pool_and_names_the_worker(comps):
    with workers.TransformerPool(comps.transformer, ["cpu", "cpu"]) as pool:
        hidden = torch.zeros(1, 7, 64)
        with pytest.raises(workers.WorkerError, match="parallel worker [01] on cpu failed"):
            pool(hidden_states=hidden, timestep=torch.zeros(1), encoder_hidden_states=torch.zeros(1, 5, 3584),
                 img_shapes=[[(1, 2, 2)]])
        assert pool.closed and all(p.returncode is not None for p in pool.processes)
        with pytest.raises(workers.WorkerError, match="closed"):
            pool(hidden_states=hidden, timestep=torch.zeros(1), encoder_hidden_states=torch.zeros(1, 5, 3584),
                 img_shapes=[[(1, 2, 2)]])


def test_one_device_is_refused_naming_the_count(monkeypatch):
    with pytest.raises(ValueError, match=r"needs at least 2 devices; this machine has 1 \(cuda:0\)"):
        workers.check_devices(["cuda:0"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"this machine has 0 \(no CUDA GPU\).*QWEN_EDIT_PARALLEL_DEVICES"):
        workers.parallel_devices({})
    assert workers.parallel_devices({workers.DEVICES_ENV: "cpu, cpu"}) == ["cpu", "cpu"]
    with pytest.raises(ValueError, match="name a GPU twice"):
        workers.check_devices(["cuda:1", "cuda:1"])


def test_too_little_shared_memory_is_refused_before_any_worker_starts(monkeypatch):
    """Docker's 64 MB /dev/shm cannot hold a real model's CPU weights: the pool says what to do instead of
    letting its workers die mid-transfer."""
    from diffusers import QwenImageTransformer2DModel

    from qwen_edit_core.families.qwen_image.tiny import transformer_config
    model = QwenImageTransformer2DModel(**transformer_config("tiny", num_layers=1))
    needed = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    assert workers.host_tensor_bytes(model) == needed
    assert isinstance(workers.shm_free_bytes(), int)  # this Linux machine has a /dev/shm
    monkeypatch.setattr(workers, "shm_free_bytes", lambda path=workers.SHM_DIR: needed - 1)
    monkeypatch.setattr(workers, "_start_worker", lambda: pytest.fail("a worker started"))
    with pytest.raises(ValueError, match=r"through /dev/shm, which has .* free: .*docker run --shm-size=1g"):
        workers.TransformerPool(model, ["cpu", "cpu"])
    workers.check_shared_memory(model, free=needed)  # exactly enough is enough
    workers.check_shared_memory(model.to("meta"), free=0)  # no CPU tensors: nothing to share
