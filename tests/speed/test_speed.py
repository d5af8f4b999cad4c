"""Speed/memory levers keep the numbers: fp8 base within tolerance, selective checkpointing and block
offloading exact, compiled blocks equal, the memory planner's choices, and a full training run with levers."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from safetensors.torch import load_file

from qwen_edit_core.adapters import multires as batching
from qwen_edit_core.adapters import lora
from qwen_edit_core import speed as perf
from qwen_edit_core.families.qwen_image.tiny import transformer_config

from conftest import train_config
from tolerances import TINY_FORWARD_ROUNDINGS, TINY_SAMPLER_ROUNDINGS, assert_close_fp32


def _model(num_layers=4, dtype=torch.float32):
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(**transformer_config("tiny", num_layers=num_layers))
    lora.inject_lora(model, lora.LoraSpec(rank=4, alpha=4.0, targets=lora.TARGET_PRESETS["attn"]))
    with torch.no_grad():
        for layer in lora.adapter_layers(model).values():
            layer.lora_B["default"].weight.normal_(0, 0.1)
    batching.install(model)
    return model.to(dtype)


def _batch(dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, 2 * 48, 64, generator=g).to(dtype)  # 6x8 target + 6x8 control tokens
    text = torch.randn(1, 20, 32, generator=g).to(dtype)
    target = torch.randn(1, 48, 16 * 4, generator=g).to(dtype)
    return hidden, text, target


def _loss(model, dtype=torch.float32, grad=False):
    hidden, text, target = _batch(dtype)
    with torch.set_grad_enabled(grad):
        pred = model(hidden_states=hidden, timestep=torch.tensor([0.6], dtype=dtype), encoder_hidden_states=text,
                     img_shapes=[[(1, 6, 8), (1, 6, 8)]], return_dict=False)[0][:, :48]
        loss = (pred.float() - target.float()).pow(2).mean()
    if grad:
        loss.backward()
    return loss


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def test_fp8_linear_forward_and_backward_match_the_dequantized_weight():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96).requires_grad_(False)
    fp8 = perf.Fp8Linear(linear)
    x = torch.randn(32, 64, requires_grad=True)
    y = fp8(x)
    ref = x @ linear.weight.t() + linear.bias
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert ((y - ref).norm() / ref.norm()).item() < 0.05  # e4m3 weights and activations: ~2% here
    g = torch.randn_like(y)
    y.backward(g)
    # The input gradient is taken against the dequantized weight, in the input's precision.
    # (g * scale) @ W8 against g @ (W8 * scale): sums over the 96 outputs, the scale applied on the other side
    assert_close_fp32(x.grad, g @ fp8.dequantized(torch.float32), ops=96 + 2, what="fp8 layer's input gradient")
    assert fp8.weight_fp8.dtype == torch.float8_e4m3fn and fp8.weight_fp8.element_size() == 1


#: e4m3 keeps 3 mantissa bits: rounding moves a value by at most half a unit in the last place, 2^-4 of it
E4M3_HALF_ULP = 2.0 ** -4


def _prediction(model, dtype=torch.bfloat16) -> torch.Tensor:
    hidden, text, _ = _batch(dtype)
    with torch.no_grad():
        return model(hidden_states=hidden, timestep=torch.tensor([0.6], dtype=dtype), encoder_hidden_states=text,
                     img_shapes=[[(1, 6, 8), (1, 6, 8)]], return_dict=False)[0][:, :48].float()


def _relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).norm() / ref.norm()).item()


def test_fp8_base_predicts_within_e4m3_rounding_of_the_bf16_base():
    """The transformer's prediction (not a loss against a random target, which hides it) with the fp8 base is
    within e4m3's half-ulp (2^-4) of the bf16 base's, relative: each weight and activation is rounded by at most
    that much, and bf16's own rounding (2^-9) is far below it. Measured: 0.7%. A wrong scale (x2) lands at 33%."""
    ref = _model(dtype=torch.bfloat16)
    fast = copy.deepcopy(ref)
    n = perf.quantize_fp8(fast)
    assert n == 4 * 14  # per block: 8 attention projections, 2 x 2 MLP linears, 2 modulations
    expected = _prediction(ref)
    assert _relative_error(_prediction(fast), expected) < E4M3_HALF_ULP
    broken = copy.deepcopy(fast)  # the same check fails on an fp8 base with wrong scales
    for layer in (m for m in broken.modules() if isinstance(m, perf.Fp8Linear)):
        layer.weight_scale.data *= 2
    assert _relative_error(_prediction(broken), expected) > 2 * E4M3_HALF_ULP
    # the LoRA stays trainable and in its own dtype; gradients flow through the fp8 base to it
    _loss(ref, torch.bfloat16, grad=True)
    _loss(fast, torch.bfloat16, grad=True)
    grads, ref_grads = _grads(fast), _grads(ref)
    assert grads.keys() == ref_grads.keys()
    flat = torch.cat([g.float().flatten() for g in grads.values()])
    ref_flat = torch.cat([g.float().flatten() for g in ref_grads.values()])
    assert all(g.dtype == torch.bfloat16 for g in grads.values())
    assert torch.nn.functional.cosine_similarity(flat, ref_flat, dim=0) > 0.99
    assert perf.quantize_fp8(fast) == 0  # idempotent


def test_fp8_backward_keeps_the_gradients_within_cosine_099():
    """train.fp8_backward: the base's input gradients as fp8 matmuls (e4m3, per-row scales, the channel
    scales folded into the gradient); the LoRA gradients stay aligned with bf16's."""
    ref = _model(dtype=torch.bfloat16)
    slow, fast = copy.deepcopy(ref), copy.deepcopy(ref)
    perf.quantize_fp8(slow)
    perf.quantize_fp8(fast, fp8_backward=True)
    for model in (ref, slow, fast):
        _loss(model, torch.bfloat16, grad=True)
    flat = {name: torch.cat([g.float().flatten() for g in _grads(m).values()])
            for name, m in (("ref", ref), ("slow", slow), ("fast", fast))}
    assert torch.nn.functional.cosine_similarity(flat["fast"], flat["ref"], dim=0) > 0.99
    assert not torch.equal(flat["fast"], flat["slow"])  # the fp8 path ran
    assert _loss(fast, torch.bfloat16).item() == _loss(slow, torch.bfloat16).item()  # forward unchanged
    x = torch.randn(32, 32, dtype=torch.bfloat16, requires_grad=True)
    layer = next(m for m in fast.modules() if isinstance(m, perf.Fp8Linear) and m.in_features == 32)
    layer(x).float().square().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and x.grad.shape == x.shape


@pytest.mark.parametrize("n_checkpointed", [0, 1, -1])
def test_selective_checkpointing_gives_the_same_loss_and_gradients(n_checkpointed):
    ref = _model()
    loss_ref = _loss(ref, grad=True)
    model = _model()
    chosen = perf.checkpoint_blocks(model, n_checkpointed)
    assert chosen == perf.checkpointed_indices(4, n_checkpointed)
    model.train()
    loss = _loss(model, grad=True)
    assert loss.item() == loss_ref.item()
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, _grads(ref)[name], rtol=0, atol=0)


def test_offloaded_blocks_give_the_same_training_step_and_hold_no_weights_between_calls():
    ref = _model()
    loss_ref = _loss(ref, grad=True)
    model = _model()
    perf.checkpoint_blocks(model, -1)
    offloader = perf.BlockOffloader(model.transformer_blocks, [1, 3], torch.device("cpu"))
    assert model.transformer_blocks[1].attn.to_q.base_layer.weight.numel() == 0  # lives in host copies
    model.train()
    for _ in range(2):  # the second step reuses the prefetch state of the first
        model.zero_grad(set_to_none=True)
        loss = _loss(model, grad=True)
        assert loss.item() == loss_ref.item()
        for name, g in _grads(model).items():
            torch.testing.assert_close(g, _grads(ref)[name], rtol=0, atol=0)
    with torch.no_grad():  # sampling with offloaded blocks
        assert _loss(model).item() == loss_ref.item()
    offloader.remove()
    assert model.transformer_blocks[1].attn.to_q.base_layer.weight.numel() > 0
    assert _loss(model).item() == loss_ref.item()


def test_offload_indices_spread_over_the_model():
    assert perf.offload_indices(60, 0) == []
    assert perf.offload_indices(60, 30) == list(range(1, 60, 2))
    assert len(perf.offload_indices(60, 31)) == 31 and perf.offload_indices(4, 9) == [0, 1, 2, 3]


REAL = {"n_blocks": 60, "block_params": 339_000_000, "other_params": 60_000_000, "tokens": 8192 + 512,
        "dim": 3072, "trainable_params": 14_000_000}
REAL_WEIGHTS = (60 * REAL["block_params"] + REAL["other_params"]) * 2  # bf16


def test_memory_planner_picks_the_fastest_settings_that_fit():
    roomy = perf.plan_for_budget(78, **REAL)
    assert not roomy.offload_blocks and roomy.estimate.total <= 78 * 2**30
    small = perf.plan_for_budget(16, **REAL)
    assert small.fp8 and small.offload_blocks > 0
    assert small.offload_blocks <= (60 if small.checkpoint_blocks < 0 else small.checkpoint_blocks)
    assert small.estimate.total <= 16 * 2**30
    tighter = perf.plan_for_budget(12, **REAL)
    assert tighter.offload_blocks > small.offload_blocks
    with pytest.raises(ValueError, match="memory_budget_gb 2 is too small"):
        perf.plan_for_budget(2, **REAL)


REAL_BLOCK = {"n_blocks": 60, "block_params": 339_831_296, "other_params": 40_523_328, "dim": 3072,
              "trainable_params": 23_592_960}


def test_the_time_model_weighs_a_recompute_against_the_copies_that_make_room_for_its_activations(monkeypatch):
    """One compiled block's activations at 1024^2 Edit with a real prompt are the fp8 weights of about 2.4 blocks
    (`plan_seconds`' docstring); a plan costs its recomputes plus its copies' exposed share. Where copies hide
    behind compute, a 40 GiB budget offloads and recomputes less than the default plan; where the link is slow, a
    budget that fits without offloading never offloads; offloaded blocks are always among the checkpointed ones."""
    from qwen_edit_core.speed import planner
    sizes, tokens = planner.compiled_sizes(REAL_BLOCK, True), 9601
    activations = planner.ACTIVATION_FACTOR_COMPILED * tokens * REAL_BLOCK["dim"] * 2
    assert 2.3 < activations / REAL_BLOCK["block_params"] < 2.5
    forward = planner.block_forward_seconds(block_params=REAL_BLOCK["block_params"], tokens=tokens, dim=3072)
    common = dict(tokens=tokens, fp8=True, **sizes)
    assert perf.plan_seconds(n_checkpointed=7, n_offloaded=0, **common) == pytest.approx(7 * forward)
    assert perf.plan_seconds(n_checkpointed=0, n_offloaded=0, **common) == 0
    copy = REAL_BLOCK["block_params"] / planner.H2D_BYTES_PER_S
    assert perf.plan_seconds(n_checkpointed=60, n_offloaded=10, **common) == pytest.approx(
        60 * forward + 10 * 2 * copy * (1 - planner.COPY_OVERLAP))  # copies shorter than a forward: their share
    default = perf.plan_for_budget(40, prefer_fp8=True, tokens=tokens, **sizes)
    assert default.offload_blocks == 0 and default.checkpoint_blocks > 0
    monkeypatch.setattr(planner, "COPY_OVERLAP", 1.0)  # copies hidden entirely
    hidden = perf.plan_for_budget(40, prefer_fp8=True, tokens=tokens, **sizes)
    assert 0 < hidden.offload_blocks <= hidden.checkpoint_blocks < default.checkpoint_blocks
    assert hidden.seconds < default.seconds and hidden.estimate.total <= 40 * 2**30
    monkeypatch.setattr(planner, "H2D_BYTES_PER_S", 1e9)  # and a slow link: every copy shows
    monkeypatch.setattr(planner, "COPY_OVERLAP", 0.0)
    slow = perf.plan_for_budget(40, prefer_fp8=True, tokens=tokens, **sizes)
    assert slow.offload_blocks == 0 and slow.checkpoint_blocks == default.checkpoint_blocks


def test_offloaded_blocks_are_checkpointed_ones_without_checkpointing_every_block(caplog):
    plan = perf.checked_plan("cpu", torch.float32, 10, fp8=False, n_checkpointed=6, n_offloaded=3)
    assert plan.checkpoint_blocks == 6 and set(plan.offloaded) <= set(range(6)) and len(plan.offloaded) == 3
    with caplog.at_level("INFO"):
        raised = perf.checked_plan("cpu", torch.float32, 10, fp8=False, n_checkpointed=2, n_offloaded=4)
    assert raised.checkpoint_blocks == 4 and set(raised.offloaded) == {0, 1, 2, 3}
    assert "checkpointing 4 blocks (not 2) for 4 offloaded" in caplog.text
    every = perf.checked_plan("cpu", torch.float32, 10, fp8=False, n_checkpointed=-1, n_offloaded=5)
    assert every.checkpoint_blocks == -1 and len(every.offloaded) == 5
    with pytest.raises(ValueError, match="needs train.gradient_checkpointing"):
        perf.checked_plan("cpu", torch.float32, 10, fp8=False, n_checkpointed=None, n_offloaded=1)


def test_a_compiled_run_is_planned_with_the_compiled_blocks_activations():
    """Compiled blocks save about 36% less than eager ones (measured on an H100): with compile on, a 76 GiB budget
    checkpoints no block where the eager constant checkpointed 19, and that plan, estimated with the compiled
    constant, holds the 52.2 GiB of tensors measured (weights and activations, +-3%). A family with its own
    constants (2.1) keeps them."""
    from qwen_edit_core.families.qwen_image_21.planner import ACTIVATION_FACTOR_21
    from qwen_edit_core.speed.planner import compiled_sizes
    from qwen_edit_core.speed.weight_plan import plan_training
    from qwen_edit_core.config import load_config
    real = {"n_blocks": 60, "block_params": 339_831_296, "other_params": 40_523_328, "dim": 3072,
            "trainable_params": 23_592_960}
    eager = perf.plan_for_budget(76, prefer_fp8=True, tokens=9601, **real)
    fast = perf.plan_for_budget(76, prefer_fp8=True, tokens=9601, **compiled_sizes(real, True))
    assert (eager.checkpoint_blocks, fast.checkpoint_blocks) == (19, 0)
    measured = perf.estimate_memory(fp8=True, n_checkpointed=19, n_offloaded=0, tokens=9601,
                                    **compiled_sizes(real, True))
    assert abs((measured.weights + measured.activations) / 2**30 - 52.2) < 0.03 * 52.2
    sizes21 = {**real, "activation_factor": ACTIVATION_FACTOR_21}
    assert compiled_sizes(sizes21, True) == sizes21 and compiled_sizes(real, False) == real
    train = load_config(overrides={"train": {"output_dir": "unused", "memory_budget_gb": 76, "fp8_base": True,
                                             "compile": True}}).train
    plan = plan_training(train, torch.device("cpu"), torch.bfloat16, real, 9601)
    assert plan.checkpoint_blocks == 0  # the training loop's own path plans with it


def test_a_model_already_in_fp8_is_planned_with_its_fp8_weights():
    """A scaled-fp8 file kept in fp8 holds one byte a weight whatever the plan: planned as bf16, a 48 GiB budget
    took a bf16 plan estimated with twice the weights (and the bf16 working set), checkpointing blocks it had room
    to keep. Told, the planner estimates only fp8 settings, as the training loop's own path does."""
    from qwen_edit_core.config import load_config
    from qwen_edit_core.speed.weight_plan import plan_training
    blind = perf.plan_for_budget(48, **REAL)
    told = perf.plan_for_budget(48, already_fp8=True, **REAL)
    assert not blind.fp8 and told.fp8 and told.checkpoint_blocks < blind.checkpoint_blocks
    assert told.estimate == perf.estimate_memory(fp8=True, n_checkpointed=told.checkpoint_blocks, n_offloaded=0,
                                                 **REAL)
    sizes = {k: v for k, v in REAL.items() if k != "tokens"}
    train = load_config(overrides={"train": {"output_dir": "unused", "memory_budget_gb": 48}}).train
    plan = plan_training(train, torch.device("cpu"), torch.bfloat16, sizes, REAL["tokens"], already_fp8=True)
    assert plan.checkpoint_blocks == told.checkpoint_blocks


def test_memory_planner_counts_one_shard_of_the_frozen_weights_per_fsdp_process():
    """Under FSDP2 over N processes each holds 1/N of the frozen weights plus the two blocks and the root's own
    weights gathered in flight; only checkpointing is planned (fp8 and offload are refused under FSDP)."""
    args = dict(fp8=False, n_checkpointed=-1, n_offloaded=0, **REAL)
    whole = perf.estimate_memory(**args).weights
    assert whole == REAL_WEIGHTS
    gathered = (2 * REAL["block_params"] + REAL["other_params"]) * 2
    for n in (2, 4, 8):
        assert perf.estimate_memory(shards=n, **args).weights == pytest.approx(whole / n + gathered * (1 - 1 / n),
                                                                               abs=1)
    alone = perf.plan_for_budget(24, **REAL)
    assert alone.fp8 and alone.offload_blocks > 0  # one process: 38.1 GiB of bf16 weights do not fit in 24
    sharded = perf.plan_for_budget(24, shards=4, **REAL)
    assert not sharded.fp8 and sharded.offload_blocks == 0 and sharded.estimate.total <= 24 * 2**30
    with pytest.raises(ValueError, match="too small for FSDP over 2 processes.*add processes"):
        perf.plan_for_budget(16, shards=2, **REAL)


def test_model_sizes_reads_the_model():
    sizes = perf.model_sizes(_model())
    assert sizes["n_blocks"] == 4 and sizes["dim"] == 32 and sizes["trainable_params"] > 0
    assert sizes["block_params"] > 0 and sizes["other_params"] > 0


@pytest.mark.slow  # inductor compilation
def test_compiled_blocks_give_the_same_loss():
    """Compiled blocks (fullgraph) give the eager numbers over repeated training steps with checkpointing and
    a no-grad call: nothing in a block (like a Python-side counter) may force a recompile per call, which
    would hit dynamo's recompile limit (8) within one step of the real 60-block model."""
    ref, model = _model(), _model()
    assert perf.compile_blocks(model) == 4
    for m in (ref, model):
        perf.checkpoint_blocks(m, 2)
    # inductor fuses and reorders the blocks' float32 arithmetic: a 4-block forward rounds about twice as often
    # as the 2-block one, the squared error doubles that; the gradients: a backward (twice the forward's) per
    # step, accumulated over 3 steps
    loss_ops, grad_ops = 4 * TINY_FORWARD_ROUNDINGS, 3 * 4 * TINY_FORWARD_ROUNDINGS
    for _ in range(3):  # 3 steps x 4 blocks x (forward + recompute) calls: far over the limit if each recompiled
        losses = [_loss(m, grad=True) for m in (ref, model)]  # forward + backward (grads accumulate)
        assert_close_fp32(losses[1], losses[0], ops=loss_ops, what="compiled training loss")
    assert_close_fp32(_loss(model), _loss(ref), ops=loss_ops, what="compiled no-grad loss")
    grads, ref_grads = _grads(model), _grads(ref)
    # a layer whose output nothing uses (the last block's text projection) has no gradient on one side and zeros
    # on the other
    one_sided = (grads.keys() | ref_grads.keys()) - (grads.keys() & ref_grads.keys())
    assert not any({**grads, **ref_grads}[n].any() for n in one_sided), sorted(one_sided)
    common = grads.keys() & ref_grads.keys()
    assert_close_fp32({n: grads[n] for n in common}, {n: ref_grads[n] for n in common}, ops=grad_ops,
                      what="compiled gradients")


#: Adam's first steps move each LoRA weight by about +-lr, the sign of its gradient. A gradient error of
#: relative size e flips the sign of the elements whose gradient is smaller than the error: for Gaussian
#: gradients a fraction ~0.8e is that small, half of them flip, and each flip differs by 2 lr, so the trained
#: weights differ by ~2 sqrt(0.4 e) relative. With e = e4m3's half-ulp (2^-4): 0.32.
LORA_UPDATE_BOUND = 2 * math.sqrt(0.4 * E4M3_HALF_ULP)


def _lora_up_error(path, ref_path) -> float:
    """Relative difference of the trained LoRA up-projections (they start at zero: all of them is training)."""
    x, ref = load_file(path), load_file(ref_path)
    ups = [k for k in ref if "lora_up" in k]
    assert ups and x.keys() == ref.keys()
    return _relative_error(torch.cat([x[k].float().flatten() for k in ups]),
                           torch.cat([ref[k].float().flatten() for k in ups]))


def test_training_with_fp8_selective_checkpointing_and_offload(tiny_edit_dir, pairs_dir, tmp_path):
    """Three steps on an fp8 base with one block checkpointed and one offloaded (both exact) train the LoRA of
    the bf16 run within LORA_UPDATE_BOUND. Measured: 0.13; with the fp8 weight scales doubled: 1.39."""
    from qwen_edit_core import QwenImageEditTrainer

    def run(out, **train):
        config = train_config(tiny_edit_dir, pairs_dir, tmp_path / out, cache_dir=tmp_path / "cache",
                              model={"dtype": "bfloat16"}, train={"max_steps": 3, **train}, logging={"plot": False})
        return QwenImageEditTrainer(config).fit()

    plain = run("plain")
    fast = run("fast", fp8_base=True, gradient_checkpointing=True, checkpoint_blocks=1, offload_blocks=1)
    assert fast.state == "done" and fast.lora_path.is_file()
    assert _lora_up_error(fast.lora_path, plain.lora_path) < LORA_UPDATE_BOUND
    with pytest.raises(ValueError, match="offload_blocks needs train.gradient_checkpointing"):
        run("bad", offload_blocks=1)


# --- sampling levers ---------------------------------------------------------------------------------------

def test_attention_kernel_keeps_the_numbers_and_names_bad_values():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 10, 16) for _ in range(3))
    mask = torch.rand(1, 1, 1, 10) > 0.3
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for name in perf.SDPA_KERNELS:
        with perf.attention_kernel(name):  # unavailable kernels (cuDNN on a CPU) fall back to the others
            got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        # another kernel's order: q.k over 16 dims, the softmax's sum and the weighted sum over 10 keys
        assert_close_fp32(got, expected, ops=16 + 10 + 10, what=f"attention with kernel {name}")
    with pytest.raises(ValueError, match="'cudn' is not accepted; accepted: auto, cudnn"):
        perf.attention_kernel("cudn")
    from qwen_edit_core.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="train.attention: 'fast' is not accepted"):
        load_config(overrides={"train": {"attention": "fast"}})


def test_the_kernels_offered_here_and_the_kernel_that_ran_are_named(monkeypatch):
    """The CPU offers torch's CPU attention alone; FlashAttention-3 is a config value whose absence is named
    with what to install; the profiler names the attention op a call ran (the benchmarks print it per row)."""
    import importlib.util

    from qwen_edit_core.config import load_config
    assert perf.offered_kernels("cpu") == ("math",)
    assert load_config(overrides={"predict": {"attention": "flash3"}}).predict.attention == "flash3"
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "flash_attn_interface" else real_find(name, *a))
    with pytest.raises(ValueError, match="'flash3' needs the 'flash_attn_interface' package"):
        perf.attention_kernel("flash3")
    q, k, v = (torch.randn(1, 4, 10, 16) for _ in range(3))
    ran = perf.kernels_ran(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), "cpu")
    assert ran and all(perf.attention.is_attention_name(name) for name, _ in ran), ran
    assert any("scaled_dot_product" in name for name, _ in ran) and 0 < ran[0][1] <= 1
    assert perf.kernels_text(ran).startswith(ran[0][0][:60])
    assert perf.kernels_text([]) == "-"


def _edit(trainer, **kwargs):
    from PIL import Image
    image = Image.new("RGB", (96, 64), (200, 30, 30))
    return trainer.predict(image, "make it green", num_inference_steps=3, seed=1, **kwargs)


def _trainer(model_dir, **predict):
    from qwen_edit_core import QwenImageEditTrainer, load_config
    trainer = QwenImageEditTrainer(load_config(overrides={
        "model": {"pretrained_model_name_or_path": str(model_dir)},
        "predict": {"vae_area": 128 * 128, **predict}}))
    trainer.load_model()
    return trainer


def _random_lora_file(model_dir, path):
    from qwen_edit_core.model.components import load_components
    from qwen_edit_core.model.devices import DevicePlan
    comps = load_components(model_dir, DevicePlan.from_mapping({}, dtype="float32"), which=("transformer",))
    spec = lora.LoraSpec(rank=4, alpha=4.0, targets=lora.TARGET_PRESETS["attn"])
    torch.manual_seed(3)
    lora.inject_lora(comps.transformer, spec)
    with torch.no_grad():
        for layer in lora.adapter_layers(comps.transformer).values():
            layer.lora_B["default"].weight.normal_(0, 0.2)
    return lora.save_lora(path, comps.transformer, spec, base_identity="tiny", steps=1)


def test_predict_fp8_stays_close_to_the_full_precision_edit_and_takes_loras_after_quantizing(tiny_edit_dir,
                                                                                           tmp_path):
    """predict.fp8 quantizes the base's block linears in place; a LoRA loaded afterwards still applies (peft
    wraps the fp8 layers), and the edit stays within 0.002 mean / 0.02 max absolute difference of the fp32 one
    (images in [0, 1]; measured 0.0003 / 0.004, where the LoRA itself moves the image by 0.0014 on average)."""
    path = _random_lora_file(tiny_edit_dir, tmp_path / "l.safetensors")
    plain = _trainer(tiny_edit_dir)
    plain.load_lora(path)
    expected = _edit(plain)
    no_lora = _trainer(tiny_edit_dir)
    without = _edit(no_lora)
    fast = _trainer(tiny_edit_dir, fp8=True, attention="math")
    fast.setup_predict()
    assert perf.has_fp8(fast.components.transformer)
    fast.load_lora(path)  # after quantization
    got = _edit(fast)
    err = float(abs(got - expected).mean())
    assert err < 0.002 and float(abs(got - expected).max()) < 0.02, err
    assert err < 0.5 * float(abs(without - expected).mean())  # the LoRA's effect is there
    with pytest.raises(ValueError, match="base is in fp8"):
        lora.merge_lora(fast.components.transformer)


@pytest.mark.slow  # inductor compilation
def test_predict_compile_and_attention_kernel_keep_the_edit(tiny_edit_dir):
    """predict.compile (each block compiled) and predict.attention give the plain sampler's edit."""
    expected = _edit(_trainer(tiny_edit_dir))
    fast = _trainer(tiny_edit_dir, compile=True, attention="efficient")
    got = _edit(fast)
    assert fast.components.transformer._qwen_edit_compiled
    # inductor's fused kernels and another attention kernel sum in another order: the run's rounding (3 steps)
    assert_close_fp32(torch.from_numpy(got), torch.from_numpy(expected), ops=TINY_SAMPLER_ROUNDINGS,
                      what="picture with compiled blocks and the efficient attention kernel vs plain")


def test_the_auto_budget_is_the_free_memory_plus_the_resident_transformer(monkeypatch):
    """memory_budget_auto (the ComfyUI Train node's default): on an 80 GB GPU where the graph's bf16 transformer
    (about 38 GiB) and text encoder (about 15 GiB) already live, the planner gets 90% of the free memory plus
    the transformer's own weights, and picks a plan without offload that fits the card."""
    model = _model()
    resident = perf.resident_bytes(model, torch.device("cpu"))
    assert resident == sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    assert perf.resident_bytes(model, torch.device("cuda")) == 0  # "cuda" is cuda:0, where nothing of it lives
    transformer, text_encoder, card = 38 * 2**30, 15 * 2**30, 80 * 2**30
    free = card - transformer - text_encoder
    budget = perf.free_memory_budget_gb(free, transformer)
    assert budget == pytest.approx(0.9 * (card - text_encoder) / 2**30)
    plan = perf.plan_for_budget(budget, **REAL)
    assert not plan.offload_blocks and plan.estimate.total - REAL_WEIGHTS <= free
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, card))
    assert perf.auto_budget_gb(model, torch.device("cuda:0")) == pytest.approx(0.9 * free / 2**30)
    assert perf.auto_budget_gb(model, torch.device("cpu")) == 0.0  # no planner off CUDA


def test_the_auto_budget_is_off_on_the_cpu_and_checkpointing_stays_on():
    model = _model()
    from qwen_edit_core.config import load_config
    train = load_config(overrides={"train": {"memory_budget_auto": True, "gradient_checkpointing": True}}).train
    levers = perf.configure_training(model, train, torch.device("cpu"), tokens=116)
    assert levers.checkpointed == (0, 1, 2, 3) and not levers.offloaded
    perf.release_training(model)
    assert not model.is_gradient_checkpointing


def test_the_fp8_forward_matmul_asks_for_fast_accumulation(monkeypatch):
    """The forward's scaled matmul asks for fast accumulation (as torchao's row-wise recipe); the kernel is
    CUDA-only, so its arguments are recorded here (the prediction guard is the benchmarks' fixed-batch loss)."""
    from qwen_edit_core.speed import fp8
    calls = []

    def scaled_mm(a, b, **kwargs):
        calls.append(kwargs)
        return torch.zeros(a.shape[0], b.shape[1], dtype=kwargs["out_dtype"])
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    weight = torch.randn(32, 64).to(fp8.FP8)
    fp8._fp8_mm(torch.randn(20, 64), weight, torch.ones(32, 1))
    assert calls and calls[0]["use_fast_accum"] is True
