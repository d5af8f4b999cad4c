"""Tolerances derived from float32 arithmetic, for tests that compare two evaluations of the same maths.

Two float32 evaluations of the same formula that round differently (another summation order: other kernels,
memory alignment, batch shape, thread split, a fused vs an unfused step) each land within about `ops` unit
roundoffs of the exact value, scaled by the size of the values along the chain, so they differ by at most
twice that. The tolerance is therefore `2 x ops x u x max|reference|` with u = 2**-24 (float32's unit
roundoff, half of `torch.finfo(torch.float32).eps`), and `ops` is the number of rounding steps (or the
accumulation depth) of the path compared, stated at each call. A real bug (a wrong scale, a dropped term, a
wrong layer) moves the result by 1e-2 of its size or more, orders of magnitude above any of these bounds.

Comparisons where both sides run the same arithmetic in the same order use `torch.equal` instead.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

#: float32's unit roundoff: one rounding moves a value by at most this fraction of its size
FP32_U = torch.finfo(torch.float32).eps / 2

#: roundings along one forward of the tiny transformer (2 blocks x ~10 matmuls, norms and attention
#: reductions, plus the input and output projections), rounded up to a power of two
TINY_FORWARD_ROUNDINGS = 32
#: roundings through the tiny VAE's encoder or decoder (~20 convolutions, norms and attention, each a short
#: accumulation), rounded up to a power of two
TINY_VAE_ROUNDINGS = 32


def tiny_sampler_roundings(steps: int) -> int:
    """Roundings along a sampler run of `steps` steps on the tiny model: one transformer forward per step
    (CFG's two branches run side by side, not one after the other) and the VAE decoder."""
    return steps * TINY_FORWARD_ROUNDINGS + TINY_VAE_ROUNDINGS


#: roundings along a short (3-step) sampler run on the tiny model
TINY_SAMPLER_ROUNDINGS = tiny_sampler_roundings(3)
#: roundings along one training step of the tiny transformer: the forward, and the backward, which runs two
#: matmuls for each of the forward's (the gradient of the input and of the weight)
TINY_TRAIN_STEP_ROUNDINGS = 3 * TINY_FORWARD_ROUNDINGS


def tiny_training_roundings(steps: int) -> int:
    """Roundings along `steps` training steps on the tiny model: the error of each step's gradients moves the
    weights the next step starts from, so the steps' roundings add up."""
    return steps * TINY_TRAIN_STEP_ROUNDINGS


#: Adam divides each gradient by its own running size, so a rounding-level difference of a gradient (ops x u of
#: the largest gradient of its tensor) changes the step (lr) of an element whose gradient is R times smaller by
#: about ops x u x R of a step, at every step. Nothing bounds R a priori (Adam's eps, 1e-8, caps it only near
#: 1e-8): the trained-LoRA comparisons cover gradients down to 1/256 of their tensor's largest (the largest
#: magnification measured on the tiny models' LoRAs is about 6).
ADAM_GRADIENT_RANGE = 256

#: roundings through the tiny text encoder (2 vision and 2 language layers of attention, MLP and norms, ~8
#: each), rounded up to a power of two
TINY_TEXT_ENCODER_ROUNDINGS = 32


def _magnitude(reference) -> float:
    """The size of `reference`: its largest absolute value (a tensor, a mapping of tensors or a number)."""
    if isinstance(reference, Mapping):
        return max((_magnitude(v) for v in reference.values()), default=0.0)
    if isinstance(reference, torch.Tensor):
        return reference.detach().abs().max().item() if reference.numel() else 0.0
    return abs(float(reference))


def fp32_tolerance(reference, *, ops: int) -> float:
    """Absolute tolerance for comparing a float32 result with `reference` (a tensor, a mapping of tensors or a
    number): `2 x ops x u x max|reference|`. `ops` is the number of float32 rounding steps (or the accumulation
    depth) of the path compared: each of the two evaluations is within `ops` unit roundoffs of the exact value,
    relative to the size of the values along the chain, so they differ by at most twice that."""
    if ops < 1:
        raise ValueError(f"ops={ops}: give the number of float32 rounding steps of the path compared (>= 1)")
    return 2 * ops * FP32_U * _magnitude(reference)


def adam_trained_size(state: Mapping, *, lr: float) -> dict:
    """What a LoRA trained by Adam steps of learning rate `lr` is as large as, key by key, for
    `assert_close_fp32(..., ops=tiny_training_roundings(steps), size=...)`: its weights' own size, plus one step
    (lr) times ADAM_GRADIENT_RANGE, by which Adam's per-element normalisation can magnify a gradient's rounding
    (the steps' count is in `ops`)."""
    return {key: _magnitude(value) + ADAM_GRADIENT_RANGE * lr for key, value in state.items()}


def max_abs_diff(got, expected) -> float:
    """The largest absolute difference between two tensors (or two mappings of tensors with the same keys),
    measured in float64 so that the measurement adds no rounding of its own."""
    if isinstance(expected, Mapping):
        assert got.keys() == expected.keys(), f"keys differ: {sorted(set(got) ^ set(expected))}"
        return max((max_abs_diff(got[k], v) for k, v in expected.items()), default=0.0)
    got, expected = torch.as_tensor(got), torch.as_tensor(expected)
    assert got.shape == expected.shape, f"shapes differ: {tuple(got.shape)} vs {tuple(expected.shape)}"
    if not expected.numel():
        return 0.0
    return (got.detach().double() - expected.detach().double()).abs().max().item()


def assert_close_fp32(got, expected, *, ops: int, what: str, size=None) -> None:
    """Assert that `got` equals `expected` within `fp32_tolerance(size, ops=ops)`; `size` (a tensor, a mapping
    of tensors or a number) is what the path's values are as large as: `expected` itself unless given (give
    the weight when `expected` is a small change of it that was computed by subtracting it). Mappings of
    tensors (state dicts) compare key by key, each against its own size. The failure names `what` differed
    (and the key), the measured error and the allowed one."""
    if isinstance(expected, Mapping):
        assert got.keys() == expected.keys(), f"{what}: keys differ: {sorted(set(got) ^ set(expected))}"
        for key, value in expected.items():
            part = size[key] if isinstance(size, Mapping) else size
            assert_close_fp32(got[key], value, ops=ops, what=f"{what} [{key}]", size=part)
        return
    size = expected if size is None else size
    error, allowed = max_abs_diff(got, expected), fp32_tolerance(size, ops=ops)
    assert error <= allowed, (f"{what}: max |difference| {error:.3e} > allowed {allowed:.3e} "
                              f"({ops} float32 roundings x size {_magnitude(size):.3e})")

