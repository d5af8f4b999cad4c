"""Seeded random weights for the real-size benchmarks, streamed by the product's planned loader.

`RandomSource` draws each tensor from its name alone, so every row of a bench (and a row run in a fresh process,
bench/train_planned.py) trains the same random model whatever form and place its plan gives each weight.
"""

from __future__ import annotations

import zlib
from typing import Iterator

import torch


class RandomSource:
    """A weight source (model/weight_source.py's interface) of seeded random weights for `family`'s transformer
    of `config`: matrices drawn with the spread of torch's default linear init (std 1 / sqrt(3 fan_in)), 1-D
    weights (norm scales) one, biases zero. Each tensor's values depend only on `seed` and its name; they are
    drawn on `device` (fast) and moved where the plan keeps them."""

    def __init__(self, config: dict, family, dtype: torch.dtype, device: torch.device, seed: int = 0):
        from qwen_edit_core.model.weight_source import ShapeOnlySource
        self._shapes = ShapeOnlySource(config, dtype, family)
        self.name, self.family, self._dtype, self._device, self._seed = "random weights", family, dtype, device, seed

    def config(self) -> dict:
        return self._shapes.config()

    def header(self) -> dict[str, torch.Tensor]:
        return self._shapes.header()

    def keeps_fp8(self, device: torch.device) -> bool:
        return False

    def tensor(self, key: str, shape: torch.Size) -> torch.Tensor:
        """The random tensor named `key` (see the class doc)."""
        if len(shape) == 1:
            fill = torch.zeros if key.endswith("bias") else torch.ones
            return fill(shape, dtype=self._dtype, device=self._device)
        gen = torch.Generator(device=self._device).manual_seed(zlib.crc32(f"{self._seed}:{key}".encode()))
        fan_in = shape[1:].numel()
        return (torch.randn(shape, generator=gen, device=self._device, dtype=torch.float32)
                * (3 * fan_in) ** -0.5).to(self._dtype)

    def modules(self) -> Iterator[dict[str, torch.Tensor]]:
        for tensors in self._shapes.modules():
            yield {k: self.tensor(k, v.shape) for k, v in tensors.items()}

    def convert(self, tensors: dict[str, torch.Tensor], fp8_modules: set[str], dtype: torch.dtype,
                keep: bool) -> dict[str, torch.Tensor]:
        return self._shapes.convert(tensors, fp8_modules, dtype, keep)


def random_source(dtype: torch.dtype, device: torch.device, num_layers: int | None = None) -> RandomSource:
    """`RandomSource` of the real transformer config (`num_layers` blocks; default 60), drawn on `device`."""
    from qwen_edit_core.families import DEFAULT
    config = DEFAULT.stage("tiny").transformer_config("real", num_layers=num_layers)
    return RandomSource(config, DEFAULT, dtype, device)


def random_transformer(device: torch.device, dtype: torch.dtype, plan=None, num_layers: int | None = None):
    """The real transformer config (`num_layers` blocks; default 60) with `RandomSource` weights, loaded by the
    planned loader into `plan` (default: every weight on `device` in `dtype`, no lever)."""
    from qwen_edit_core import speed
    from qwen_edit_core.model.planned_load import load_transformer_planned
    return load_transformer_planned(random_source(dtype, device, num_layers),
                                    plan or speed.WeightPlan(device=device, dtype=dtype))
