"""`qwen-edit bench train`: training step time and peak memory, cached against realtime, in one process.

Tiny (CPU): the tiny model on a synthetic 256^2 dataset; realtime encodes every batch with the text encoder
and VAE, cached reads the embedding cache. `--real-size` (GPU): the real transformer config with random
bf16 weights at 1024^2 Edit shapes (8192 image tokens and a real prompt's text tokens, `model.prompt_length`:
1,409 at 1024^2 Edit; the last row repeats the last lever at a multiple of 64 beside it), our step against the plain reference
of BENCHMARKS.md's reference timings (diffusers model + peft LoRA r16 on to_q/k/v/out.0 + gradient checkpointing + AdamW); the
realtime column there uses the real-width one-layer encoders, so it shows the plumbing, not a 7B encoder.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch
from diffusers.training_utils import cast_training_params

from qwen_edit_core.model.devices import resolve_device

from qwen_edit_core.families import DEFAULT
from qwen_edit_core.bench.common import gib_text, peak_gib, pinned_gib, print_table, reserved_gib, reset_peak, sync

log = logging.getLogger(__name__)


def _step_times(fit, device) -> list[float]:
    """Times between the training steps of `fit(progress)`. The device's peak memory is reset after the first
    step, so `peak_gib` afterwards is the steady-state step's (not the model's setup: the bench builds the whole
    bf16 transformer on the device before any lever applies, and the first step compiles)."""
    stamps = []

    def progress(event):
        if event.stage == "train":
            sync(device)
            stamps.append(time.perf_counter())
            if len(stamps) == 1:
                reset_peak(device)
    fit(progress)
    return [b - a for a, b in zip(stamps, stamps[1:])]


def _tiny(steps: int) -> str:
    from qwen_edit_core import QwenImageEditTrainer, load_config
    from qwen_edit_core.demo import write_dataset
    from qwen_edit_core.model.tiny import build_tiny

    work = Path(tempfile.mkdtemp(prefix="qwen-edit-bench-train-"))
    model = build_tiny(work / "model")
    write_dataset(work / "data", 8, seed=0)
    rows = []
    times = {}
    for mode in ("cached", "realtime"):
        config = load_config(overrides={
            "model": {"pretrained_model_name_or_path": str(model), "lora": {"rank": 16, "targets": "attn"}},
            "data": {"folder": str(work / "data"), "vae_area": 256 * 256, "batch_size": 1},
            "cache": {"dir": str(work / "cache"), "enabled": mode == "cached"},
            "train": {"output_dir": str(work / mode), "max_steps": steps}})
        trainer = QwenImageEditTrainer(config)
        if mode == "cached":
            trainer.cache()
        times[mode] = statistics.median(_step_times(lambda p, t=trainer: t.fit(progress=p), torch.device("cpu")))
    for mode in ("cached", "realtime"):
        rows.append([mode, f"{times[mode] * 1000:.1f}", "-", f"{times['realtime'] / times[mode]:.2f}"])
    return print_table(f"train: tiny model, 256^2 Edit, batch 1, LoRA r16 attn, {steps} steps, cpu",
                       ["batch source", "median ms/step", "peak GiB", "speed vs realtime"], rows)


def _real_item(device, dtype, text_tokens=1408, side=1024):
    h = w = side // 8
    g = torch.Generator().manual_seed(0)
    return {"target_latents": torch.randn(16, 1, h, w, generator=g).to(dtype),
            "control_latents_0": torch.randn(16, 1, h, w, generator=g).to(dtype),
            "prompt_embeds": torch.randn(text_tokens, 3584, generator=g).to(dtype),
            "empty_prompt_embeds": torch.randn(64, 3584, generator=g).to(dtype),
            "img_shapes": torch.tensor([[1, h // 2, w // 2], [1, h // 2, w // 2]])}


def _model_inputs(item, device, dtype):
    pack = DEFAULT.stage("sampler").pack  # the bench model is the default family's
    x0 = pack(item["target_latents"][None]).to(device, dtype)
    control = pack(item["control_latents_0"][None]).to(device, dtype)
    text = item["prompt_embeds"][None].to(device, dtype)
    shapes = [[tuple(s) for s in item["img_shapes"].tolist()]]
    return x0, control, text, shapes


def fixed_batch_loss(model, item, device, dtype) -> float:
    """The flow loss of one fixed (noise, sigma) draw: the quality guard every variant is compared on."""
    x0, control, text, shapes = _model_inputs(item, device, dtype)
    g = torch.Generator().manual_seed(123)
    noise = torch.randn(x0.shape, generator=g).to(device, dtype)
    sigma = torch.tensor([0.7], device=device, dtype=dtype)
    hidden = torch.cat([(1 - sigma) * x0 + sigma * noise, control], dim=1)
    with torch.enable_grad(), torch.autocast(device.type, dtype=dtype):  # the graph the training step compiled
        pred = model(hidden_states=hidden, timestep=sigma, encoder_hidden_states=text, img_shapes=shapes,
                     return_dict=False)[0][:, : x0.shape[1]]
    return float((pred.detach().float() - (noise - x0).float()).pow(2).mean())


_LAYERS: int | None = None  # set by _real for smoke runs


def _build(device, dtype):
    from qwen_edit_core.bench.common import real_transformer
    torch.manual_seed(0)  # every variant starts from the same random weights (LoRA B = 0: same function)
    return real_transformer(device, dtype, num_layers=_LAYERS)


def _reference(device, dtype, steps: int, item) -> dict:
    """The plain reference of BENCHMARKS.md's timings: diffusers model + peft LoRA + checkpointing + AdamW, no text mask."""
    from peft import LoraConfig
    model = _build(device, dtype)
    model.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    model.enable_gradient_checkpointing()
    model.train()
    cast_training_params(model, dtype=torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    loss0 = fixed_batch_loss(model, item, device, dtype)
    x0, control, text, shapes = _model_inputs(item, device, dtype)
    times = []
    reset_peak(device)
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        noise = torch.randn_like(x0)
        sigma = torch.rand(1, device=device, dtype=dtype)
        hidden = torch.cat([(1 - sigma) * x0 + sigma * noise, control], dim=1)
        with torch.autocast(device.type, dtype=dtype):
            pred = model(hidden_states=hidden, timestep=sigma, encoder_hidden_states=text, img_shapes=shapes,
                         return_dict=False)[0][:, : x0.shape[1]]
        loss = (pred.float() - (noise - x0).float()).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - start)
    out = {"s": statistics.median(times[1:]), "peak": peak_gib(device), "loss": loss0,
           "kernels": _attention_kernels(model, item, device, dtype, "auto")}
    del model, opt
    _free(device)
    return out


def _free(device) -> None:
    import gc
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


#: our trainer's configurations, one lever added at a time (train section overrides)
_FAST = {"compile": True, "fp8_base": True, "attention": "cudnn"}
VARIANTS = {
    "ours (checkpointing)": {"gradient_checkpointing": True},
    "+ compile": {"gradient_checkpointing": True, "compile": True},
    "+ fp8 base": {"gradient_checkpointing": True, "compile": True, "fp8_base": True},
    "+ cuDNN attention": {"gradient_checkpointing": True, **_FAST},
    "+ selective checkpointing (budget 76)": {**_FAST, "memory_budget_gb": 76},
    "+ fp8 backward": {**_FAST, "memory_budget_gb": 76, "fp8_backward": True},
    "memory_budget_gb 16": {**_FAST, "memory_budget_gb": 16},
}


def _ours(device, dtype, steps: int, item, train_overrides: dict) -> dict:
    side = item["target_latents"].shape[-1] * 8
    from qwen_edit_core.adapters import lora
    from qwen_edit_core.config import load_config
    from qwen_edit_core.data.examples import EditExample
    from qwen_edit_core.train.loop import train

    model = _build(device, dtype)
    # The product's own setup: `train` casts the LoRA to fp32 (train.loop.setup), as it does for users.
    lora.inject_lora(model, lora.LoraSpec(rank=16, alpha=16, targets=lora.TARGET_PRESETS["attn-img"]))
    work = Path(tempfile.mkdtemp(prefix="qwen-edit-bench-real-"))
    # lr 1e-30 (the config takes lr > 0): the step does the same work, and the fp32 LoRA weights do not move
    # (updates of 1e-30 vanish in rounding), so they stay those of the fixed-batch loss below.
    config = load_config(overrides={"train": {"output_dir": str(work), "max_steps": steps, "device": str(device),
                                              "mixed_precision": "bf16", **train_overrides},
                                    "optimizer": {"lr": 1e-30}, "logging": {"plot": False}})
    reset_peak(device)
    compile_start = time.perf_counter()
    example = EditExample(name="random", target=Path("random.png"), controls=(Path("random-control.png"),),
                          caption="", target_size=(side, side), control_sizes=((side, side),))
    # the lambda runs inside _step_times, before `del model` below frees the weights for the next setting
    times = _step_times(lambda p: train(config, model, lambda i: item, [example],  # noqa: F821
                                        [((side, side), ((side, side),))],
                                        scheduler_config={"max_image_seq_len": 8192, "max_shift": 0.9},
                                        write_lora=lambda path, step: None, out_dir=work, progress=p), device)
    total = time.perf_counter() - compile_start
    out = {"s": statistics.median(times), "peak": peak_gib(device), "reserved": reserved_gib(device),
           "pinned": pinned_gib(device), "first_step": total - sum(times), "planned": _planned_gib(config, model, side)}
    out["loss"] = fixed_batch_loss(model, item, device, dtype)
    out["kernels"] = _attention_kernels(model, item, device, dtype, config.train.attention)
    del model
    _free(device)
    return out


def _attention_kernels(model, item, device, dtype, attention: str) -> str:
    """The attention kernels one forward of the fixed batch launches under `attention` (profiler names)."""
    from qwen_edit_core import speed
    with speed.attention_kernel(attention):
        return speed.kernels_text(speed.kernels_ran(lambda: fixed_batch_loss(model, item, device, dtype), device))


def _planned_gib(config, model, side: int) -> float | None:
    """The memory planner's estimate for `config`'s `train.memory_budget_gb` (None without a budget), computed as
    the training loop plans it (train.loop.setup): the same sizes and sequence length."""
    from qwen_edit_core import speed
    from qwen_edit_core.train.distributed import sequence_tokens
    budget = config.train.memory_budget_gb
    if not budget:
        return None
    tokens = sequence_tokens([((side, side), ((side, side),))], config.model.variant, config.data.vl_area)
    plan = speed.plan_for_budget(budget, prefer_fp8=config.train.fp8_base, tokens=tokens,
                                 **speed.planner.compiled_sizes(speed.model_sizes(model), config.train.compile))
    return plan.estimate.total / 2**30


def step_flops(img_tokens=8192, txt_tokens=1408, dim=3072, layers=60) -> float:
    """Model FLOPs of one LoRA training step without recomputation: forward, plus the input gradients of
    the frozen linears (1x their forward) and attention's backward (2x its forward); LoRA terms are < 0.1%."""
    tokens = img_tokens + txt_tokens
    linear = 2 * layers * tokens * (4 * dim * dim + 2 * dim * 4 * dim)
    attention = 4 * layers * tokens * tokens * dim
    return 2 * linear + 3 * attention


def _device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def _real(device: str, steps: int, variants: list[str] | None = None, *, layers: int | None = None,
          side: int = 1024, text_tokens: int | None = None) -> str:
    """`layers`/`side`/`text_tokens` shrink the run for a smoke test of the plumbing (any device); `text_tokens`
    None: a real prompt's length at `side` (model.prompt_length: the control's vision tokens plus a caption)."""
    from qwen_edit_core.bench.common import matmul_peaks
    from qwen_edit_core.families import variants as model_variants
    from qwen_edit_core.model.prompt_length import prompt_tokens
    if text_tokens is None:
        text_tokens = prompt_tokens(model_variants.DEFAULT, [(side, side)])
    dev = resolve_device(device, component="bench device")
    if dev.type != "cuda" and layers is None:
        raise ValueError("--real-size needs a CUDA device: it measures the real-size transformer's GPU time "
                         "and memory")
    global _LAYERS
    _LAYERS = layers
    dtype = torch.bfloat16
    item = _real_item(dev, dtype, text_tokens=text_tokens, side=side)
    peaks = matmul_peaks(dev, n=8192 if dev.type == "cuda" else 256)
    log.info("measured matmul peaks: %s", peaks)
    flops = step_flops(img_tokens=2 * (side // 16) ** 2, txt_tokens=text_tokens, layers=layers or 60)
    ref = _reference(dev, dtype, steps, item)
    results = [("diffusers + peft reference (no mask)", ref)]
    for name in variants or list(VARIANTS):
        try:
            log.info("%s: device memory at the start %.1f GiB", name,
                     torch.cuda.memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0)
            results.append((name, _ours(dev, dtype, steps, item, VARIANTS[name])))
            log.info("%s: %s (reference %s)", name, results[-1][1], ref)  # kept if a time limit cuts the run
        except Exception as err:  # noqa: BLE001 - a failed lever is reported in the table, the others still run
            log.exception("variant %s failed", name)
            results.append((name, {"error": f"{type(err).__name__}: {err}"[:120]}))
            _free(dev)
    aligned, first = text_tokens // 64 * 64, results[1] if len(results) > 1 else None
    if 0 < aligned != text_tokens and first is not None and "error" not in first[1]:
        # the first lever again at a multiple of 64 text tokens: what an odd prompt length costs the kernels
        name = f"{first[0]} at {aligned} text tokens"
        try:
            results.append((name, _ours(dev, dtype, steps, _real_item(dev, dtype, text_tokens=aligned, side=side),
                                        VARIANTS[first[0]])))
        except Exception as err:  # noqa: BLE001 - reported in the table
            log.exception("variant %s failed", name)
            results.append((name, {"error": f"{type(err).__name__}: {err}"[:120]}))
            _free(dev)
    rows = []
    for name, r in results:
        if "error" in r:
            rows.append([name, "failed", "-", "-", "-", "-", "-", "-", "-", "-", r["error"]])
            continue
        rows.append([name, f"{r['s']:.3f}", gib_text(r["peak"]), gib_text(r.get("reserved")),
                     gib_text(r.get("pinned")), gib_text(r.get("planned")),
                     f"{100 * flops / r['s'] / peaks['bf16'] / 1e12:.0f}%",
                     f"{ref['s'] / r['s']:.2f}", f"{100 * (r['loss'] - ref['loss']) / ref['loss']:+.2f}%",
                     f"{r.get('first_step', 0):.0f}", r["kernels"]])
    return print_table(f"train: real-size random transformer ({layers or 60} blocks), {side}^2 Edit ({2 * (side // 16) ** 2} image + "
                       f"{text_tokens} text tokens), batch 1, "
                       f"bf16, LoRA r16, {dev} ({_device_name(dev)}); MFU against the measured bf16 "
                       f"peak {peaks['bf16']:.0f} TFLOP/s (fp8 {peaks['fp8']:.0f}); step = {flops:.2e} FLOPs",
                       ["implementation", "median s/step", "peak GiB", "reserved GiB", "pinned GiB", "planned GiB",
                        "MFU", "speed vs reference", "fixed-batch loss vs reference", "first step s (compile)",
                        "attention kernels (share of profiled forward)"], rows)


def run(real_size: bool = False, device: str = "cpu", steps: int = 10, variants: list[str] | None = None) -> str:
    return _real(device, steps, variants) if real_size else _tiny(steps)
