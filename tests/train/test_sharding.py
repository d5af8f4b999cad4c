"""Sharded training (FSDP2 through accelerate, 2 CPU processes over gloo): the frozen base is split across the
processes, the LoRA trained equals one process's, and a sharded run's checkpoint resumes exactly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import assert_compiled_lora_close, train_config
from tolerances import adam_trained_size, assert_close_fp32, tiny_training_roundings
from safetensors.torch import load_file

from qwen_edit_core import QwenImageEditTrainer

REPO = Path(__file__).resolve().parents[2]
FSDP_CONFIG = REPO / "examples" / "fsdp2.yaml"


def _launch(config: dict, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    path = tmp_path / f"fsdp-{len(list(tmp_path.glob('fsdp-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(config))
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([accelerate, "launch", "--config_file", str(FSDP_CONFIG), "--num_processes", "2",
                           "-m", "qwen_edit_core.cli", "train", str(path), *extra],
                          capture_output=True, text=True, timeout=900, env=env, cwd=REPO)


def _config(model_dir, data_dir, out_dir, cache_dir, max_steps: int) -> dict:
    return {"model": {"pretrained_model_name_or_path": str(model_dir),
                      "lora": {"rank": 4, "alpha": 4.0, "targets": "all"}},
            "data": {"folder": str(data_dir), "vae_area": 4096, "batch_size": 2},
            "cache": {"dir": str(cache_dir)},
            "train": {"output_dir": str(out_dir), "max_steps": max_steps, "seed": 3, "checkpoint_every": 2},
            "optimizer": {"lr": 1e-3}}


def _max_diff(a: Path, b: Path) -> float:
    x, y = load_file(a), load_file(b)
    assert x.keys() == y.keys()
    return max((x[k].float() - y[k].float()).abs().max().item() for k in x)


@pytest.mark.slow  # accelerate launch: several processes
def test_fsdp_two_processes_equal_one_process_and_resume_exactly(tiny_edit_dir, pairs_dir, tmp_path):
    cache = tmp_path / "cache"
    full = _launch(_config(tiny_edit_dir, pairs_dir, tmp_path / "fsdp", cache, 4), tmp_path)
    assert full.returncode == 0, full.stderr[-3000:]
    assert "FSDP: frozen base sharded over 2 processes" in full.stderr
    single = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "one", cache_dir=cache,
                                               train={"max_steps": 4, "seed": 3})).fit()
    sharded_lora = tmp_path / "fsdp" / "lora.safetensors"
    # each process's forward (one pair) and the gradient all-reduce round differently from one process's batch
    # of two: four steps' rounding and one more for the average, magnified by Adam (adam_trained_size)
    expected = load_file(single.lora_path)
    assert_close_fp32(load_file(sharded_lora), expected, ops=tiny_training_roundings(4) + 1,
                      size=adam_trained_size(expected, lr=1e-3), what="LoRA of 2 FSDP processes vs one")
    # Resume from the sharded run's own step-2 checkpoint, in another output directory: the same LoRA.
    step2 = tmp_path / "fsdp" / "checkpoints" / "step-0000002"
    # It also validates at step 4: every process takes part in the sharded sampling, the first one writes.
    config = _config(tiny_edit_dir, pairs_dir, tmp_path / "resumed", cache, 4)
    config["train"].update(validation_every=4, validation_steps=2, validation_prompt="invert the colors",
                           validation_image=str(pairs_dir / "p0_control.png"))
    resumed = _launch(config, tmp_path, "--resume", str(step2))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _max_diff(sharded_lora, tmp_path / "resumed" / "lora.safetensors") == 0.0
    assert (tmp_path / "resumed" / "validation" / "step-0000004.png").is_file()


@pytest.mark.slow  # accelerate launch: several processes
def test_sharding_plan_splits_frozen_blocks_and_keeps_the_lora_whole(tiny_edit_dir, tmp_path):
    """Every transformer block is an FSDP unit whose frozen weights are sharded (DTensors, half the rows on each
    of 2 processes); the LoRA parameters stay plain, whole tensors."""
    script = tmp_path / "plan.py"
    script.write_text(PLAN_SCRIPT)
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([accelerate, "launch", "--config_file", str(FSDP_CONFIG), "--num_processes", "2",
                           str(script), str(tiny_edit_dir)], capture_output=True, text=True, timeout=600, env=env,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    blocks, units, local_rows, full_rows, lora = proc.stdout.split()[-5:]
    assert int(units) == int(blocks) >= 2
    assert int(local_rows) * 2 == int(full_rows)
    assert lora == "lora-whole"


PLAN_SCRIPT = """
import sys
import torch
from accelerate import Accelerator
from qwen_edit_core.adapters import lora
from diffusers import QwenImageTransformer2DModel
from qwen_edit_core.train import sharding
from torch.distributed.tensor import DTensor

accelerator = Accelerator(cpu=True)
model = QwenImageTransformer2DModel.from_pretrained(sys.argv[1], subfolder="transformer").requires_grad_(False)
lora.inject_lora(model, lora.LoraSpec(rank=4, alpha=4.0, targets="all"))
model = sharding.shard_frozen_base(model, accelerator.device, accelerator.num_processes)
blocks = model.transformer_blocks
units = sum(1 for b in blocks if type(b).__name__.startswith("FSDP"))
weight = blocks[0].attn.to_q.base_layer.weight
assert isinstance(weight, DTensor), type(weight)
trainable = [p for n, p in model.named_parameters() if p.requires_grad]
whole = trainable and not any(isinstance(p, DTensor) for p in trainable)
if accelerator.is_main_process:
    print(len(blocks), units, weight.to_local().shape[0], weight.shape[0], "lora-whole" if whole else "lora-sharded")
"""


def _tiny_transformer():
    from diffusers import QwenImageTransformer2DModel

    from qwen_edit_core.families.qwen_image.tiny import transformer_config
    return QwenImageTransformer2DModel(**transformer_config("tiny")).requires_grad_(False)


@pytest.mark.parametrize("train, lever", [({"offload_blocks": 2}, "train.offload_blocks"),
                                          ({"fp8_base": True}, "train.fp8_base")])
def test_levers_fsdp_cannot_take_are_refused_before_any_weight_loads(tiny_edit_dir, pairs_dir, tmp_path,
                                                                    monkeypatch, train, lever):
    from qwen_edit_core.model import components
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("WORLD_SIZE", "2")

    def no_loading(*args, **kwargs):
        raise AssertionError("a weight was loaded before the levers were checked")
    monkeypatch.setattr(components, "load_components", no_loading)
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path, train={"gradient_checkpointing": True, **train})
    with pytest.raises(ValueError, match=f"{lever}.* not available under FSDP"):
        QwenImageEditTrainer(config).fit()


def test_fp8_base_is_refused_with_the_reason(monkeypatch):
    from qwen_edit_core import speed
    from qwen_edit_core.train import sharding
    monkeypatch.setenv("FSDP_VERSION", "2")
    model = _tiny_transformer()
    speed.quantize_fp8(model)
    with pytest.raises(ValueError, match="cannot shard an fp8 base.*train.fp8_base"):
        sharding.shard_frozen_base(model, torch.device("cpu"), 2)


def test_fsdp1_config_is_refused(monkeypatch):
    from qwen_edit_core.train import sharding
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match="fsdp_version: 2.*examples/fsdp2.yaml"):
        sharding.shard_frozen_base(_tiny_transformer(), torch.device("cpu"), 2)


@pytest.mark.slow
def test_fsdp_with_checkpointing_and_compiled_blocks_equals_one_eager_process(one_block_dir, pairs_dir, tmp_path):
    """FSDP2 over 2 processes with every block checkpointed and compiled (inductor; FSDP2's hooks run around
    each compiled forward) trains the LoRA of one eager process without levers. A one-block model: each process
    compiles one block graph (minutes of CPU with a cold cache), the FSDP unit, its hooks and the recompute are
    the same per block."""
    cache = tmp_path / "cache"
    config = _config(one_block_dir, pairs_dir, tmp_path / "fsdp", cache, 3)
    config["train"].update(gradient_checkpointing=True, compile=True)
    sharded = _launch(config, tmp_path)
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert "FSDP: frozen base sharded over 2 processes" in sharded.stderr
    assert "compiled transformer block graph" in sharded.stderr and "fell back to eager" not in sharded.stderr
    single_config = train_config(one_block_dir, pairs_dir, tmp_path / "one", cache_dir=cache,
                                 train={"max_steps": 3, "seed": 3})
    single = QwenImageEditTrainer(single_config).fit()
    # inductor's fused kernels and the gradient all-reduce round differently: three steps' rounding and one
    # more for the average; the model's only block is its last
    assert_compiled_lora_close(load_file(tmp_path / "fsdp" / "lora.safetensors"), load_file(single.lora_path),
                               ops=tiny_training_roundings(3) + 1, last_block=0,
                               lr=single_config.optimizer.lr, what="LoRA of 2 compiled FSDP processes vs one eager")


@pytest.mark.parametrize("model, data, transformer_class", [
    ("tiny_edit_dir", "pairs_dir", "QwenImageTransformer2DModel"),
    ("tiny_21_dir", "refs_dir", "QwenImage21Transformer2DModel")], ids=["edit", "image-2.1"])
def test_a_sharded_run_reads_the_transformer_into_host_memory_not_onto_its_device(model, data, transformer_class,
                                                                                 request, tmp_path, monkeypatch):
    """Under FSDP2 the plan made before loading keeps every weight on the host (the model's dtype, nothing
    offloaded, no fp8), whatever the device and the budget: `fully_shard` then moves one block at a time to the
    device and keeps the process's share, so no device ever holds the whole transformer. The loader follows
    that plan, for either family's transformer, and the levers are planned later for the process's share (not
    a training plan)."""
    from qwen_edit_core import speed
    from qwen_edit_core.model import components
    from qwen_edit_core.model.devices import resolve_dtype
    from qwen_edit_core.train import run
    model_dir, data_dir = request.getfixturevalue(model), request.getfixturevalue(data)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = train_config(model_dir, data_dir, tmp_path, train={"gradient_checkpointing": True,
                                                                "memory_budget_gb": 16})
    plan = run.training_plan(config, torch.device("cuda:0"), model_dir, [((64, 64), ((64, 64),))],
                             run.lora_spec(config))
    assert plan == speed.WeightPlan(device=torch.device("cpu"), dtype=resolve_dtype(config.model.dtype))
    loaded = components.load_components(model_dir, run.encoder_plan(config), which=("transformer",),
                                        transformer_plan=plan).transformer
    assert type(loaded).__name__ == transformer_class
    assert {t.device.type for t in (*loaded.parameters(), *loaded.buffers())} == {"cpu"}
    assert speed.loaded_plan(loaded) is None and not speed.has_fp8(loaded)
