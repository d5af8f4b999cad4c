"""`qwen-edit bench train`: training step time and peak memory, cached against realtime, in one process.

Tiny (CPU): the tiny model on a synthetic 256^2 dataset; realtime encodes every batch with the text encoder
and VAE, cached reads the embedding cache. `--real-size` (GPU): the real transformer config with random
bf16 weights at 1024^2 Edit shapes (8192 image + 1,408 text tokens), our step against the plain reference
of FACTS.md §5 (diffusers model + peft LoRA r16 on to_q/k/v/out.0 + gradient checkpointing + AdamW); the
realtime column there uses the real-width one-layer encoders, so it shows the plumbing, not a 7B encoder.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

from qwen_edit_core.devices import resolve_device

from .common import peak_gib, print_table, reset_peak, sync

log = logging.getLogger(__name__)


def _step_times(fit, device) -> list[float]:
    stamps = []

    def progress(event):
        if event.stage == "train":
            sync(device)
            stamps.append(time.perf_counter())
    fit(progress)
    return [b - a for a, b in zip(stamps, stamps[1:])]


def _tiny(steps: int) -> str:
    from qwen_edit_core import QwenImageEditTrainer, load_config
    from qwen_edit_core.demo import write_dataset
    from qwen_edit_core.tiny import build_tiny

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


def _reference_step_time(device, dtype, steps: int, item) -> tuple[float, float]:
    """FACTS.md §5's plain reference: diffusers model + peft LoRA + checkpointing + AdamW, no text mask."""
    from peft import LoraConfig

    from qwen_edit_core import encode

    from .common import real_transformer
    model = real_transformer(device, dtype)
    model.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    model.enable_gradient_checkpointing()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    opt = torch.optim.AdamW(params, lr=1e-4)
    x0 = encode.pack(item["target_latents"][None]).to(device, dtype)
    control = encode.pack(item["control_latents_0"][None]).to(device, dtype)
    text = item["prompt_embeds"][None].to(device, dtype)
    shapes = [[tuple(s) for s in item["img_shapes"].tolist()]]
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
    peak = peak_gib(device)
    del model, opt
    torch.cuda.empty_cache()
    return statistics.median(times[1:]), peak


def _ours_step_time(device, dtype, steps: int, item) -> tuple[float, float]:
    from qwen_edit_core import lora
    from qwen_edit_core.config import load_config
    from qwen_edit_core.trainer import train

    from .common import real_transformer
    model = real_transformer(device, dtype)
    lora.inject_lora(model, lora.LoraSpec(rank=16, alpha=16, targets=lora.TARGET_PRESETS["attn-img"]))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    work = Path(tempfile.mkdtemp(prefix="qwen-edit-bench-real-"))
    config = load_config(overrides={"train": {"output_dir": str(work), "max_steps": steps, "device": str(device),
                                              "mixed_precision": "bf16", "gradient_checkpointing": True},
                                    "logging": {"plot": False}})
    reset_peak(device)
    times = _step_times(lambda p: train(config, model, lambda i: item, [None], [((1024, 1024), ((1024, 1024),))],
                                        scheduler_config={"max_image_seq_len": 8192, "max_shift": 0.9},
                                        write_lora=lambda path, step: None, out_dir=work, progress=p), device)
    return statistics.median(times), peak_gib(device)


def _real(device: str, steps: int) -> str:
    dev = resolve_device(device, component="bench device")
    if dev.type != "cuda":
        raise ValueError("--real-size needs a CUDA device (the real transformer is 41 GiB in bf16)")
    dtype = torch.bfloat16
    item = _real_item(dev, dtype)
    t_ref, m_ref = _reference_step_time(dev, dtype, steps, item)
    t_ours, m_ours = _ours_step_time(dev, dtype, steps, item)
    rows = [["diffusers + peft reference (no mask)", f"{t_ref:.3f}", f"{m_ref:.1f}", "1.00"],
            ["qwen_edit_core trainer (cached)", f"{t_ours:.3f}", f"{m_ours:.1f}", f"{t_ref / t_ours:.2f}"]]
    return print_table(f"train: real-size random transformer, 1024^2 Edit, batch 1, bf16, LoRA r16, {dev}",
                       ["implementation", "median s/step", "peak GiB", "speed vs reference"], rows)


def run(real_size: bool = False, device: str = "cpu", steps: int = 10) -> str:
    return _real(device, steps) if real_size else _tiny(steps)
