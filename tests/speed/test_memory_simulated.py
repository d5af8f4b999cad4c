"""The memory planner's promise, checked at real size on the CPU: the simulated training step of the 16 GiB
plan (1024^2 Edit, the real 60-block transformer, real token counts, the product's levers, LoRA and AdamW
under FakeTensorMode; bench/memory.py) holds at most 16 GiB on the device, margin included, and the
planner's estimate is within 15% of it."""

from __future__ import annotations

import pytest
import torch

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


def test_one_simulated_forward_counts_every_weight_byte_and_the_attention_flops():
    """One real-width block at 1024^2 Edit, one forward (the `split` lever's share of a CFG step): the tracked
    parameters are the model's own bytes, and the FLOPs are the linears' 2 x tokens x weights plus fused
    attention's 4 x S^2 x width (QK^T and PV), which torch's counter misses on the CPU unless mapped."""
    result = memory.simulate_sample("edit", 1024, lever="split", num_layers=1)
    from qwen_edit_core.bench import fake_model
    model = fake_model.fake_transformer("edit", fake_model.fake_mode(), num_layers=1,
                                        lora=memory.lora_spec("attn"))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert result.categories_gib["Parameter"] == pytest.approx(weight_bytes / 2**30, abs=1e-3)
    n_img, n_txt, width = 2 * 64 * 64, result.text_tokens, 3072

    def tokens_of(name: str) -> int:
        if any(k in name for k in ("_mod", "time_text_embed", "norm_out")):
            return 1  # the timestep's modulation: one row
        return n_txt if any(k in name for k in ("add_", "txt_mlp", "txt_in")) else n_img
    linears = sum(2 * tokens_of(name) * m.weight.numel() for name, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and "lora" not in name)
    attention = 4 * (n_img + n_txt) ** 2 * width  # QK^T and PV, 2 x S^2 x head_dim x heads each
    # what is left out: the LoRA's rank-16 products and the elementwise work (well under 1%)
    assert result.flops_per_step == pytest.approx(linears + attention, rel=0.01)
