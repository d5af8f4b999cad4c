"""The optimizer and the learning-rate schedule over the LoRA parameters."""

from __future__ import annotations

import torch

from qwen_edit_core.config import Config

SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine")
#: devices where torch's fused AdamW runs (torch.optim.adam: CUDA, and the CPU since torch 2.4)
FUSED_DEVICES = ("cuda", "cpu")


def make_optimizer(params, config: Config):
    params = list(params)
    o = config.optimizer
    if o.type == "adamw":
        # fused: one kernel per step, and it takes the loop's device skip flag (`found_inf`), so a non-finite
        # step is skipped without reading the device (train.loop.optimizer_step)
        fused = all(p.device.type in FUSED_DEVICES and p.dtype.is_floating_point for p in params) or None
        return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, eps=o.eps,
                                 fused=fused)
    if o.type == "adamw8bit":
        if any(p.device.type != "cuda" for p in params):
            raise ValueError("optimizer.type adamw8bit (bitsandbytes) needs the LoRA on a CUDA device; "
                             "use adamw on this device")
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ValueError("optimizer.type adamw8bit needs bitsandbytes (pip install bitsandbytes) and a CUDA "
                             "device; use adamw") from None
        return bnb.optim.AdamW8bit(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, eps=o.eps)
    raise ValueError(f"optimizer.type {o.type!r} is not accepted; accepted: adamw, adamw8bit")


def make_lr_scheduler(optimizer, config: Config):
    from diffusers.optimization import get_scheduler
    s = config.lr_scheduler
    if s.type not in SCHEDULES:
        raise ValueError(f"lr_scheduler.type {s.type!r} is not accepted; accepted: {', '.join(SCHEDULES)}")
    return get_scheduler(s.type, optimizer, num_warmup_steps=s.warmup_steps,
                         num_training_steps=config.train.max_steps)


def trainable_parameters(transformer) -> dict[str, torch.nn.Parameter]:
    """The LoRA parameters, by name, in registration order (the optimizer's order)."""
    return {name: p for name, p in transformer.named_parameters() if p.requires_grad}
