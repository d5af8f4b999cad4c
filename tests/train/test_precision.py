"""LoRA parameters and optimizer state train in float32 whatever the frozen base's dtype."""

from __future__ import annotations

import pytest
import torch

from conftest import train_config


def _bf16_transformer(model_dir):
    from qwen_edit_core.adapters import lora
    from qwen_edit_core.model.components import load_components
    from qwen_edit_core.model.devices import DevicePlan
    comps = load_components(model_dir, DevicePlan.from_mapping({}, dtype="bfloat16"), which=("transformer",))
    lora.inject_lora(comps.transformer, lora.LoraSpec(rank=4, alpha=4.0, targets=lora.resolve_targets("all")))
    return comps.transformer


@pytest.mark.parametrize("fp8_base", [False, True])
def test_lora_params_and_optimizer_state_are_fp32_on_a_bf16_or_fp8_base(tiny_edit_dir, pairs_dir, tmp_path,
                                                                        fp8_base):
    from qwen_edit_core.train import loop
    transformer = _bf16_transformer(tiny_edit_dir)
    assert transformer.img_in.weight.dtype == torch.bfloat16
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path, train={"fp8_base": fp8_base,
                                                                     "mixed_precision": "bf16"})
    key = ((64, 64), ((64, 64),))
    run = loop.setup(config, transformer, [key, key], tmp_path, None, {})
    assert run.params and all(p.dtype == torch.float32 for p in run.params.values())
    for p in run.params.values():
        p.grad = torch.ones_like(p)
    run.optimizer.step()
    states = [s for s in run.optimizer.state.values()]
    assert states and all(s["exp_avg"].dtype == torch.float32 and s["exp_avg_sq"].dtype == torch.float32
                          for s in states)
    # The frozen base keeps its own dtype.
    assert transformer.img_in.weight.dtype == torch.bfloat16
