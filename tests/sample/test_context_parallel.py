"""Context-parallel sampling on 2 CPU processes (torchrun, gloo): the tokens split over the processes (Ulysses,
uneven splits) give the image of one process, at true CFG (sequential and batched) and at CFG 1; bad setups are
refused with the reason. Ring attention needs a CUDA kernel that returns the log-sum-exp: refused on the CPU.
With cfg_mode split on 4 processes, cond runs on two and uncond on the other two (each pair splitting tokens)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from qwen_edit_core import QwenImageEditTrainer, load_config

from tolerances import assert_close_fp32, tiny_sampler_roundings

REPO = Path(__file__).resolve().parents[2]
PROMPT = "make the square blue and the background a little darker"  # an odd prompt token count

SCRIPT = """
import logging, os, sys
import numpy as np
from PIL import Image
from qwen_edit_core import QwenImageEditTrainer, load_config
logging.basicConfig(level=logging.INFO)
model, image, out, prompt, cfg_modes, steps = sys.argv[1:7]
for cfg_mode in cfg_modes.split(","):
    config = load_config(overrides={"model": {"pretrained_model_name_or_path": model},
                                    "predict": {"vae_area": 96 * 64, "context_parallel": 2, "cfg_mode": cfg_mode}})
    trainer = QwenImageEditTrainer(config)
    trainer.load_model()
    result = trainer.predict(Image.open(image), prompt, num_inference_steps=int(steps), true_cfg_scale=4.0, seed=5)
    np.save(f"{out}-{cfg_mode}-rank{os.environ['RANK']}.npy", result)
"""


def _torchrun(*args: str, nproc: int = 2, timeout: int = 900) -> subprocess.CompletedProcess:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([torchrun, "--nproc_per_node", str(nproc), "--master_port",
                           str(29600 + os.getpid() % 300), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO)


def _single(model_dir, image: Path, cfg: float, steps: int = 3) -> np.ndarray:
    config = load_config(overrides={"model": {"pretrained_model_name_or_path": str(model_dir)},
                                    "predict": {"vae_area": 96 * 64}})
    trainer = QwenImageEditTrainer(config)
    trainer.load_model()
    return trainer.predict(Image.open(image), PROMPT, num_inference_steps=steps, true_cfg_scale=cfg, seed=5)


@pytest.fixture(scope="module")
def wide_control(tmp_path_factory) -> Path:
    """A 96x64 control: 24 image tokens per image at this area, split unevenly with the prompt's tokens."""
    path = tmp_path_factory.mktemp("cp") / "control.png"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)).save(path)
    return path


@pytest.mark.slow  # torchrun: several processes
def test_two_processes_equal_one_process_with_either_cfg_batching(tiny_edit_dir, wide_control, tmp_path):
    script = tmp_path / "cp.py"
    script.write_text(SCRIPT)
    proc = _torchrun(str(script), str(tiny_edit_dir), str(wide_control), str(tmp_path / "cp"), PROMPT,
                     "sequential,batched", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = _single(tiny_edit_dir, wide_control, 4.0)
    for cfg_mode in ("sequential", "batched"):
        split = np.load(tmp_path / f"cp-{cfg_mode}-rank0.npy")
        assert split.shape == reference.shape
        # the processes split the tokens (their matmuls and attention sum in another order): the picture differs
        # by the rounding of the sampler run
        assert_close_fp32(torch.from_numpy(split), torch.from_numpy(reference), ops=tiny_sampler_roundings(3),
                          what=f"picture from 2 processes vs one, cfg_mode {cfg_mode}")


@pytest.mark.slow  # torchrun: several processes
def test_cfg_split_over_two_groups_of_two_equals_one_process(tiny_edit_dir, wide_control, tmp_path):
    """4 processes: cond on ranks 0-1, uncond on ranks 2-3, each pair splitting its tokens (Ulysses); the
    predictions are swapped once per step. Every rank ends with the image of one process."""
    script = tmp_path / "cp.py"
    script.write_text(SCRIPT)
    proc = _torchrun(str(script), str(tiny_edit_dir), str(wide_control), str(tmp_path / "cp"), PROMPT, "split",
                     "2", nproc=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 of 4, cond branch" in proc.stderr and "rank 3 of 4, uncond branch" in proc.stderr
    reference = _single(tiny_edit_dir, wide_control, 4.0, steps=2)
    for rank in range(4):
        split = np.load(tmp_path / f"cp-split-rank{rank}.npy")
        assert split.shape == reference.shape
        assert_close_fp32(torch.from_numpy(split), torch.from_numpy(reference), ops=tiny_sampler_roundings(2),
                          what=f"picture on rank {rank} of 4 vs one process")


def test_cfg_split_needs_twice_the_processes(monkeypatch):
    from qwen_edit_core.sample import context_parallel
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"needs 4 processes \(2 for cond, 2 for uncond with --cfg-mode split\)"
                                         r".*torchrun --nproc_per_node 4.*this run has 2"):
        context_parallel.init_process_group(2, torch.device("cpu"), cfg_split=True)


def test_backend_without_the_collectives_is_refused():
    from qwen_edit_core.sample import context_parallel
    with pytest.raises(ValueError, match="backend 'nccl' has no collectives for cpu tensors.*needs gloo"):
        context_parallel.check_backend("nccl", "cpu")
    with pytest.raises(ValueError, match="backend 'gloo' has no collectives for cuda tensors.*needs nccl"):
        context_parallel.check_backend("gloo", "cuda")
    with pytest.raises(ValueError, match="runs on cpu or cuda devices, not mps"):
        context_parallel.check_backend("gloo", "mps")
    context_parallel.check_backend("cpu:gloo,cuda:nccl", "cuda")
    context_parallel.check_backend("cpu:gloo", "cpu")


@pytest.mark.slow  # torchrun: several processes
def test_cli_at_cfg_1_equals_one_process(tiny_edit_dir, wide_control, tmp_path):
    """CFG 1 (the few-step case, where the two-device CFG split has nothing to split)."""
    common = ["--model", str(tiny_edit_dir), "--image", str(wide_control), "--prompt", PROMPT, "--steps", "3",
              "--cfg", "1", "--seed", "5", "--vae-area", str(96 * 64)]
    proc = _torchrun("-m", "qwen_edit_core.cli", "sample", *common, "--context-parallel", "2",
                     "--out", str(tmp_path / "cp.png"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    from qwen_edit_core.cli import main
    assert main(["sample", *common, "--out", str(tmp_path / "one.png")]) == 0
    split, one = (np.asarray(Image.open(tmp_path / name), dtype=np.int16) for name in ("cp.png", "one.png"))
    # the split sums in another order: within the run's float32 rounding (about 1e-5 of [0, 1]), which moves an
    # 8-bit value only where it lies at a rounding boundary, and then by one level
    assert split.shape == one.shape and np.abs(split - one).max() <= 1


def test_one_process_asked_for_two_is_refused(tiny_edit_dir, wide_control, tmp_path, monkeypatch):
    from qwen_edit_core.sample import context_parallel
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="needs 2 processes: .*torchrun --nproc_per_node 2.*this run has 1"):
        context_parallel.init_process_group(2, torch.device("cpu"))


def test_multi_resolution_processor_and_bad_head_split_are_refused(tiny_edit_dir):
    from qwen_edit_core.adapters import multires
    from qwen_edit_core.sample import context_parallel
    trainer = QwenImageEditTrainer(load_config(overrides={"model": {"pretrained_model_name_or_path":
                                                                    str(tiny_edit_dir)}}))
    trainer.load_model()
    transformer = trainer.components.transformer
    with pytest.raises(ValueError, match="ulysses context parallel splits the 2 attention heads over 3"):
        context_parallel.enable(transformer, 3, "ulysses")
    multires.install(transformer)
    with pytest.raises(ValueError, match="JointAttnProcessor.*sample from a fresh load"):
        context_parallel.enable(transformer, 2, "ring")
    with pytest.raises(ValueError, match="mode 'tensor' is not accepted; accepted: ulysses, ring"):
        context_parallel.enable(transformer, 2, "tensor")


def test_ring_on_the_cpu_is_refused_with_the_reason(tiny_edit_dir):
    from qwen_edit_core.sample import context_parallel
    trainer = QwenImageEditTrainer(load_config(overrides={"model": {"pretrained_model_name_or_path":
                                                                    str(tiny_edit_dir)}}))
    trainer.load_model()
    with pytest.raises(ValueError, match="ring context parallel needs .*log-sum-exp.*use --cp-mode ulysses"):
        context_parallel.enable(trainer.components.transformer, 2, "ring")
