"""`qwen-edit bench train`: training step time and peak memory, cached against realtime, in one process.

Tiny (CPU): the tiny model on a synthetic 256^2 dataset; realtime encodes every batch with the text encoder
and VAE, cached reads the embedding cache. `--real-size` (GPU): the real transformer config with random
bf16 weights at 1024^2 Edit shapes (8192 image tokens and a real prompt's text tokens, `model.prompt_length`:
1,409 at 1024^2 Edit; the last row repeats the last lever at a multiple of 64 beside it), our step against the
plain reference of BENCHMARKS.md's reference timings (diffusers model + peft LoRA r16 on to_q/k/v/out.0 + gradient
checkpointing + AdamW); the realtime column there uses the real-width one-layer encoders, so it shows the
plumbing, not a 7B encoder.
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from diffusers.training_utils import cast_training_params

from qwen_edit_core import speed
from qwen_edit_core.model.devices import resolve_device

from qwen_edit_core.families import DEFAULT
from qwen_edit_core.bench.common import (bench_dtype, gib_text, peak_gib, pinned_gib, print_table, reserved_gib,
                                         reset_peak, sync, top_kernels)

log = logging.getLogger(__name__)


def _step_times(fit, device, steps: int | None = None) -> tuple[list[float], list[tuple[str, float]] | None]:
    """(times between the training steps of `fit(progress)`, the kernels of its last step) where `steps` (the
    run's step count) is given: that step alone runs under torch's profiler and is left out of the times
    (`speed.kernel_shares`; None without `steps`). The device's peak memory is reset after the first step, so
    `peak_gib` afterwards is the steady-state step's (not the model's setup, nor the first step's compile)."""
    from torch.profiler import ProfilerActivity, profile
    stamps, prof = [], None

    def progress(event):
        nonlocal prof
        if event.stage == "train":
            sync(device)
            stamps.append(time.perf_counter())
            if len(stamps) == 1:
                reset_peak(device)
            if steps is not None and len(stamps) == steps - 1:
                prof = profile(activities=[ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU])
                prof.start()
            elif prof is not None and len(stamps) == steps:
                prof.stop()
    fit(progress)
    times = [b - a for a, b in zip(stamps, stamps[1:])]
    if prof is None:
        return times, None
    return times[:-1], speed.kernel_shares(prof, device.type == "cuda")


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
        times[mode] = statistics.median(_step_times(lambda p, t=trainer: t.fit(progress=p), torch.device("cpu"))[0])
    for mode in ("cached", "realtime"):
        rows.append([mode, f"{times[mode] * 1000:.1f}", "-", f"{times['realtime'] / times[mode]:.2f}"])
    return print_table(f"train: tiny model, 256^2 Edit, batch 1, LoRA r16 attn, {steps} steps, cpu",
                       ["batch source", "median ms/step", "peak GiB", "speed vs realtime"], rows)


def real_item(text_tokens: int = 1408, side: int = 1024, dtype: torch.dtype = torch.bfloat16) -> dict:
    """A cached example's tensors at 1024^2 Edit shapes (`side`^2 target and control, `text_tokens` prompt
    tokens), seeded: the bench's one training batch."""
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
    # the graph the training step compiled: gradients on, autocast, and training mode (a compiled block's graph
    # is guarded on its modules' `training` flags: in eval mode each row compiled its blocks again; dropout is 0)
    was_training = model.training
    model.train()
    try:
        with torch.enable_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            pred = model(hidden_states=hidden, timestep=sigma, encoder_hidden_states=text, img_shapes=shapes,
                         return_dict=False)[0][:, : x0.shape[1]]
    finally:
        model.train(was_training)
    return float((pred.detach().float() - (noise - x0).float()).pow(2).mean())


_LAYERS: int | None = None  # set by _real for smoke runs


def _build(device, dtype):
    """The real-size transformer with the seeded random weights every row (and the planned row's own process)
    shares, whole on `device` (bench/random_weights.py `RandomSource`; LoRA B = 0: the same function)."""
    from qwen_edit_core.bench.random_weights import random_transformer
    return random_transformer(device, dtype, num_layers=_LAYERS)


def _reference(device, dtype, steps: int, item) -> dict:
    """The plain reference of BENCHMARKS.md's timings: diffusers model + peft LoRA + checkpointing + AdamW, no text
    mask."""
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
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
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
    "memory_budget_gb 16": {**_FAST, "memory_budget_gb": 16, "fp8_backward": True},  # as the fastest row
}


#: rows measured as users run them: planned before any weight loads, in a fresh process (bench/train_planned.py)
PLANNED_ROWS = ("memory_budget_gb 16",)


def bench_config(device: torch.device, steps: int, train_overrides: dict):
    """The product's config for a bench row: `train_overrides` on bf16 autocast (none off CUDA), `steps` steps, no
    plot."""
    from qwen_edit_core.config import load_config
    work = Path(tempfile.mkdtemp(prefix="qwen-edit-bench-real-"))
    # lr 1e-30 (the config takes lr > 0): the step does the same work, and the fp32 LoRA weights do not move
    # (updates of 1e-30 vanish in rounding), so they stay those of the fixed-batch loss below.
    return load_config(overrides={"train": {"output_dir": str(work), "max_steps": steps, "device": str(device),
                                            "mixed_precision": "bf16" if device.type == "cuda" else "no",
                                            **train_overrides},
                                  "optimizer": {"lr": 1e-30}, "logging": {"plot": False}})


def train_row(model, device, dtype, steps: int, item, config, *, profile_last: bool = False) -> dict:
    """Train `config` (bench_config) on `model` with the product's own setup (`train.loop.train`: the LoRA
    injected here, cast to fp32 there, every lever applied) for `steps` steps on the fixed batch `item`: median
    step seconds, peaks, the fixed-batch loss, the attention kernels; `profile_last`: the last step's kernels
    (`top kernels`, left out of the median)."""
    from qwen_edit_core.adapters import lora
    from qwen_edit_core.data.examples import EditExample
    from qwen_edit_core.train.loop import train
    side = item["target_latents"].shape[-1] * 8
    lora.inject_lora(model, lora.LoraSpec(rank=16, alpha=16, targets=lora.TARGET_PRESETS["attn-img"]))
    reset_peak(device)
    compile_start = time.perf_counter()
    example = EditExample(name="random", target=Path("random.png"), controls=(Path("random-control.png"),),
                          caption="", target_size=(side, side), control_sizes=((side, side),))
    out_dir = Path(config.train.output_dir)
    times, kernels = _step_times(lambda p: train(config, model, lambda i: item, [example],
                                                 [((side, side), ((side, side),))],
                                                 scheduler_config={"max_image_seq_len": 8192, "max_shift": 0.9},
                                                 write_lora=lambda path, step: None, out_dir=out_dir, progress=p),
                                 device, steps if profile_last else None)
    total = time.perf_counter() - compile_start
    out = {"s": statistics.median(times), "peak": peak_gib(device), "reserved": reserved_gib(device),
           "pinned": pinned_gib(device), "first_step": total - sum(times),
           "planned": _planned_gib(config, model, side)}
    out["loss"] = fixed_batch_loss(model, item, device, dtype)
    out["kernels"] = _attention_kernels(model, item, device, dtype, config.train.attention)
    if kernels is not None:
        out["top"] = top_kernels(kernels)
    return out


#: the marker of the planned row's result line on its process's stdout
PLANNED_RESULT = "planned-row "


def _in_fresh_process(device: str, steps: int, overrides: dict, *, text_tokens: int, side: int,
                     layers: int | None = None) -> dict:
    """bench/train_planned.py `planned_row` run by a new Python process (its log goes to this one's stderr); its
    result."""
    args = json.dumps({"device": device, "steps": steps, "overrides": overrides, "text_tokens": text_tokens,
                       "side": side, "layers": layers})
    proc = subprocess.run([sys.executable, "-m", "qwen_edit_core.bench.train_planned", args], stdout=subprocess.PIPE,
                          text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(PLANNED_RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the fresh process of the planned row exited with {proc.returncode} and no result "
                           "(its log above says why)")
    return json.loads(lines[-1][len(PLANNED_RESULT):])


def _cpu_safe(overrides: dict, device: torch.device) -> dict:
    """`overrides` without the fp8 levers off CUDA (a smoke run of the plumbing: fp8 matmuls need a GPU)."""
    if device.type == "cuda":
        return overrides
    return {**overrides, "fp8_base": False, "fp8_backward": False}


def _ours(device, dtype, steps: int, item, name: str) -> dict:
    overrides = _cpu_safe(VARIANTS[name], device)
    if name in PLANNED_ROWS:
        return _in_fresh_process(str(device), steps, overrides, text_tokens=item["prompt_embeds"].shape[0],
                                side=item["target_latents"].shape[-1] * 8, layers=_LAYERS)
    model = _build(device, dtype)
    out = train_row(model, device, dtype, steps, item, bench_config(device, steps, overrides))
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


def _row(name: str, r: dict, ref: dict, peak_seconds: float) -> list[str]:
    """One table row of result `r` (an `error` or `train_row`'s figures) against the reference's; `peak_seconds`:
    the step's FLOPs at the measured bf16 peak (for MFU)."""
    if "error" in r:
        return [name, "failed", "-", "-", "-", "-", "-", "-", "-", "-", r["error"], "-"]
    return [name, f"{r['s']:.3f}", gib_text(r["peak"]), gib_text(r.get("reserved")), gib_text(r.get("pinned")),
            gib_text(r.get("planned")), f"{100 * peak_seconds / r['s']:.0f}%", f"{ref['s'] / r['s']:.2f}",
            f"{100 * (r['loss'] - ref['loss']) / ref['loss']:+.2f}%", f"{r.get('first_step', 0):.0f}", r["kernels"],
            r.get("top", "-")]


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
    dtype = bench_dtype(dev)
    item = real_item(text_tokens=text_tokens, side=side, dtype=dtype)
    peaks = matmul_peaks(dev, n=8192 if dev.type == "cuda" else 256)
    log.info("measured matmul peaks: %s", peaks)
    flops = step_flops(img_tokens=2 * (side // 16) ** 2, txt_tokens=text_tokens, layers=layers or 60)
    ref = _reference(dev, dtype, steps, item)
    results = [("diffusers + peft reference (no mask)", ref)]
    for name in variants or list(VARIANTS):
        try:
            log.info("%s: device memory at the start %.1f GiB", name,
                     torch.cuda.memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0)
            results.append((name, _ours(dev, dtype, steps, item, name)))
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
            results.append((name, _ours(dev, dtype, steps, real_item(text_tokens=aligned, side=side, dtype=dtype),
                                        first[0])))
        except Exception as err:  # noqa: BLE001 - reported in the table
            log.exception("variant %s failed", name)
            results.append((name, {"error": f"{type(err).__name__}: {err}"[:120]}))
            _free(dev)
    rows = [_row(name, r, ref, flops / peaks["bf16"] / 1e12) for name, r in results]
    image_tokens = 2 * (side // 16) ** 2
    return print_table(f"train: real-size random transformer ({layers or 60} blocks), {side}^2 Edit ({image_tokens} "
                       f"image + {text_tokens} text tokens), batch 1, "
                       f"{str(dtype).removeprefix('torch.')}, LoRA r16, {dev} ({_device_name(dev)}); MFU against the "
                       f"measured bf16 peak {peaks['bf16']:.0f} TFLOP/s (fp8 {peaks['fp8']:.0f}); "
                       f"step = {flops:.2e} FLOPs",
                       ["implementation", "median s/step", "peak GiB", "reserved GiB", "pinned GiB", "planned GiB",
                        "MFU", "speed vs reference", "fixed-batch loss vs reference", "first step s (compile)",
                        "attention kernels (share of profiled forward)",
                        "top CUDA kernels (share of a profiled step; planned rows)"], rows)


def run(real_size: bool = False, device: str = "cpu", steps: int = 10, variants: list[str] | None = None) -> str:
    return _real(device, steps, variants) if real_size else _tiny(steps)
