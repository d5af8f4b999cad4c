"""The training bench's planned rows: seeded random weights that do not depend on the plan, and the runbook's
shell syntax (a syntax error would cost the GPU time it is given)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch

from qwen_edit_core import speed
from qwen_edit_core.bench.common import top_kernels
from qwen_edit_core.bench.random_weights import RandomSource
from qwen_edit_core.families import DEFAULT
from qwen_edit_core.model.planned_load import load_transformer_planned
from qwen_edit_core.families.qwen_image.tiny import transformer_config

CPU = torch.device("cpu")


def _load(plan: speed.WeightPlan):
    return load_transformer_planned(RandomSource(transformer_config("tiny"), DEFAULT, torch.float32, CPU), plan)


def test_random_weights_depend_on_their_names_alone_not_on_the_plan_or_the_order():
    """What the planned loader streams is each tensor as `RandomSource.tensor` draws it by name, so an offloaded
    block gets the numbers it gets when resident (whatever the plan reads first)."""
    state = _load(speed.WeightPlan(device=CPU, dtype=torch.float32)).state_dict()
    source = RandomSource(transformer_config("tiny"), DEFAULT, torch.float32, CPU)
    streamed = {k: v for tensors in source.modules() for k, v in tensors.items()}
    assert streamed.keys() == state.keys() and all(torch.equal(streamed[k], state[k]) for k in state)
    key = "transformer_blocks.1.attn.to_q.weight"
    assert torch.equal(source.tensor(key, state[key].shape), state[key])


def test_random_weights_have_the_default_inits_spread_and_unit_norms():
    state = _load(speed.WeightPlan(device=CPU, dtype=torch.float32)).state_dict()
    weight = state["transformer_blocks.0.attn.to_q.weight"]
    assert abs(float(weight.std()) * (3 * weight.shape[1]) ** 0.5 - 1) < 0.1
    assert torch.equal(state["transformer_blocks.0.attn.to_q.bias"], torch.zeros_like(weight[:, 0]))
    norms = [k for k, v in state.items() if v.ndim == 1 and k.endswith("norm_q.weight")]
    assert norms and all(torch.equal(state[k], torch.ones_like(state[k])) for k in norms)
    other = RandomSource(transformer_config("tiny"), DEFAULT, torch.float32, CPU, seed=1)
    assert not torch.equal(other.tensor("transformer_blocks.0.attn.to_q.weight", weight.shape), weight)


def test_top_kernels_names_each_with_its_share():
    assert top_kernels([("gemm_a", 0.5), ("flash_fwd", 0.25), ("x", 0.1)], top=2) == "gemm_a 50%; flash_fwd 25%"
    assert top_kernels([]) == "-"


def test_the_runbook_parses_and_offers_a_cpu_smoke_run():
    script = Path(speed.__file__).parents[1] / "bench" / "device_run.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True).returncode == 0
    assert "all|smoke)" in script.read_text()
