"""The memory planner plans for the sequence a step really runs: the text stream holds the control images'
vision tokens (model/prompt_length.py), so a larger Edit control means a longer prompt and a larger estimate."""

from __future__ import annotations

import pytest
import torch

from conftest import train_config

from qwen_edit_core.model.prompt_length import CAPTION_TOKENS, prompt_tokens


@pytest.mark.parametrize("variant, controls, vision", [
    ("edit", [(1024, 1024)], 37 * 37),  # the VL sees the VAE-sized control: 1024/28 rounds to 37
    ("edit", [(1536, 1536)], 55 * 55),  # 3,025: the text stream grows with the control
    ("edit", [(512, 768)], 18 * 27),
    ("edit-plus", [(1024, 1024)] * 2, 2 * 14 * 14),  # each control at 384x384 whatever its size
    ("edit-2511", [(1536, 1536)] * 3, 3 * 14 * 14),
    ("edit-plus", [(1024, 512)], 19 * 9),  # 384^2 at 2:1 is 544x256 (sides rounded to 32)
    ("image-2.1", [(1024, 1024)] * 2, 0),  # references' latent tokens replace their vision slots
])
def test_the_prompt_holds_the_controls_vision_tokens_plus_a_caption(variant, controls, vision):
    assert prompt_tokens(variant, controls) == vision + CAPTION_TOKENS


def test_an_undetected_variant_counts_the_longest_prompt_for_that_many_controls():
    assert prompt_tokens("", [(1024, 1024)]) == prompt_tokens("edit", [(1024, 1024)]) == 1409
    assert prompt_tokens("", [(1024, 1024)] * 2) == prompt_tokens("edit-plus", [(1024, 1024)] * 2) == 432


def _spy_planner(monkeypatch):
    """Record every (tokens, estimate) the budget planner is asked for."""
    from qwen_edit_core.speed import weight_plan
    calls, real = [], weight_plan.plan_for_budget

    def spy(budget_gb, **kwargs):
        chosen = real(budget_gb, **kwargs)
        calls.append((kwargs["tokens"], chosen.estimate.total, kwargs))
        return chosen
    monkeypatch.setattr(weight_plan, "plan_for_budget", spy)
    return calls


def test_the_training_plan_estimates_the_runs_real_sequence(tiny_edit_dir, pairs_dir, tmp_path, monkeypatch):
    """A 1536^2 Edit bucket plans for 2 x 96^2 image tokens plus 3,065 text tokens (not a fixed 1,409), and the
    estimate grows with the text: the same model at the old fixed length estimates less."""
    from qwen_edit_core import speed
    from qwen_edit_core.train import run
    calls = _spy_planner(monkeypatch)
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path, train={"gradient_checkpointing": True,
                                                                     "memory_budget_gb": 16})
    run.training_plan(config, torch.device("cpu"), tiny_edit_dir, [((512, 512), ((512, 512),)),
                                                                  ((1536, 1536), ((1536, 1536),))],
                      run.lora_spec(config))
    (tokens, estimate, kwargs), = calls
    assert tokens == 2 * 96 * 96 + 55 * 55 + CAPTION_TOKENS == 21497
    sizes = {k: v for k, v in kwargs.items() if k not in ("tokens", "prefer_fp8", "shards", "already_fp8", "no_fp8",
                                                             "no_offload")}
    chosen = speed.plan_for_budget(16, tokens=2 * 96 * 96 + 1409, **sizes)
    fixed = speed.estimate_memory(fp8=chosen.fp8, n_checkpointed=chosen.checkpoint_blocks,
                                  n_offloaded=chosen.offload_blocks, tokens=2 * 96 * 96 + 1409, **sizes)
    same_plan = speed.estimate_memory(fp8=chosen.fp8, n_checkpointed=chosen.checkpoint_blocks,
                                      n_offloaded=chosen.offload_blocks, tokens=tokens, **sizes)
    assert same_plan.activations > fixed.activations and estimate >= fixed.total


def test_the_levers_plan_for_the_runs_real_sequence(tiny_plus_dir, pairs_dir, tmp_path, monkeypatch):
    """`train.loop.setup` (the levers of a transformer loaded any other way) plans an Edit Plus run with two
    1024^2 controls for its 196 vision tokens per control, not an Edit prompt's 1,369."""
    from qwen_edit_core.adapters import lora
    from qwen_edit_core.model.components import load_components
    from qwen_edit_core.model.devices import DevicePlan
    from qwen_edit_core.train import loop
    calls = _spy_planner(monkeypatch)
    transformer = load_components(tiny_plus_dir, DevicePlan.from_mapping({}), which=("transformer",)).transformer
    lora.inject_lora(transformer, lora.LoraSpec(rank=4, alpha=4.0, targets=lora.resolve_targets("all")))
    config = train_config(tiny_plus_dir, pairs_dir, tmp_path, model={"variant": "edit-plus"},
                          train={"gradient_checkpointing": True, "memory_budget_gb": 16})
    loop.setup(config, transformer, [((1024, 1024), ((1024, 1024),) * 2)], tmp_path, None, {})
    assert [c[0] for c in calls] == [3 * 64 * 64 + 2 * 14 * 14 + CAPTION_TOKENS]
