"""An exponential moving average of the trained LoRA parameters (`train.ema_decay`).

After every optimizer step, `shadow = decay * shadow + (1 - decay) * param` (float32, on the parameters'
device), starting from the parameters before the first step. So after n steps with parameters p_1 .. p_n,
`shadow_n = decay^n * p_0 + (1 - decay) * sum_k decay^(n-k) * p_k`. The average is saved beside the trained
LoRA (`NAME_ema.safetensors`), kept in every checkpoint (`ema.safetensors`, exact) and restored on resume,
and can stand in for the trained weights during validation (`train.ema_validation`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Mapping

import torch


def check_decay(decay: float) -> float:
    """`train.ema_decay` must be 0 (off) or in (0, 1)."""
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"train.ema_decay {decay!r} is not accepted; use 0 (off) or a value in (0, 1), e.g. 0.999")
    return float(decay)


class LoraEma:
    """The moving average of named parameters (float32 copies)."""

    def __init__(self, params: Mapping[str, torch.nn.Parameter], decay: float):
        self.decay = check_decay(decay)
        self.shadow = {name: p.detach().float().clone() for name, p in params.items()}

    @torch.no_grad()
    def update(self, params: Mapping[str, torch.nn.Parameter], skip: torch.Tensor | None = None) -> None:
        """One step of the average: shadow = decay * shadow + (1 - decay) * param. `skip`: a device flag (1: the
        optimizer skipped this step), under which the average stays exactly as it was, without a host read."""
        for name, p in params.items():
            shadow = self.shadow[name]
            value = p.detach().to(shadow.device, torch.float32)
            if skip is None:
                shadow.mul_(self.decay).add_(value, alpha=1.0 - self.decay)
            else:
                shadow.copy_(torch.where(skip.to(shadow.device) > 0, shadow,
                                         shadow.mul(self.decay).add_(value, alpha=1.0 - self.decay)))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averages by parameter name (CPU float32 copies, for a checkpoint)."""
        return {name: t.detach().cpu().clone() for name, t in self.shadow.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore the averages of a checkpoint; every parameter must be present."""
        missing = sorted(set(self.shadow) - set(state))
        if missing:
            raise ValueError(f"EMA state lacks {missing[:3]}: resume with the same model.lora settings")
        for name, shadow in self.shadow.items():
            shadow.copy_(state[name].to(shadow.device, torch.float32))

    @contextlib.contextmanager
    def applied(self, params: Mapping[str, torch.nn.Parameter]) -> Iterator[None]:
        """Within the block the parameters hold the averages; afterwards exactly their own values again."""
        saved = {name: p.detach().clone() for name, p in params.items()}
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(self.shadow[name].to(p.device, p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(saved[name])
