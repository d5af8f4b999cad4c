"""What a cache entry's tensors must be: their names, dtypes and shapes for a key (`check_tensors`, also on
meta tensors read from a header), and the tensors as stored (`prepare_tensors`). data/cache.py stores and
reads entries and re-exports these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import torch

from qwen_edit_core.families import FAMILIES, family_of

if TYPE_CHECKING:
    from qwen_edit_core.data.cache import CacheKey

#: 2: the empty prompt of caption dropout is `families.templates.EMPTY_PROMPT` (" "), as at inference; format-1
#: entries hold the embeddings of "" and are recomputed rather than trained on.
CACHE_FORMAT_VERSION = 2
#: Tensors every entry holds, besides `control_latents_{i}` for each of its controls.
CACHE_TENSORS = ("target_latents", "prompt_embeds", "empty_prompt_embeds", "img_shapes")
EMBEDDING_TENSORS = ("prompt_embeds", "empty_prompt_embeds")
#: the optional float32 tensor of an entry whose key has a mask_hash: (target tokens,) loss-weight fractions
LOSS_MASK = "loss_mask"


def control_names(n_controls: int) -> tuple[str, ...]:
    """`control_latents_0` .. `control_latents_{n-1}`."""
    return tuple(f"control_latents_{i}" for i in range(n_controls))

def float_dtype(name: str) -> torch.dtype:
    """The torch floating dtype named `name` ("float32", "bfloat16", ...); ValueError otherwise."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"cache key dtype {name!r} is not a torch floating dtype (e.g. 'float32', 'bfloat16')")
    return dtype

def prepare_tensors(key: CacheKey, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors as stored: on the CPU, contiguous, floats in the key's dtype, `img_shapes` int64.
    ValueError if a name is missing or unexpected, or a dtype, rank or shape is wrong."""
    if key.format_version != CACHE_FORMAT_VERSION:
        raise ValueError(f"this code writes cache format {CACHE_FORMAT_VERSION}, not {key.format_version}")
    dtype = float_dtype(key.dtype)
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().to("cpu")
        if name == "img_shapes" and not tensor.is_floating_point():
            tensor = tensor.to(torch.int64)
        elif name == LOSS_MASK:
            tensor = tensor.float()
        elif name != "img_shapes" and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[name] = tensor.contiguous()
    problem = check_tensors(key, out) or next(
        (f"{name} holds non-finite values (NaN/Inf from the encoders; try model.dtype float32)"
         for name, t in sorted(out.items()) if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
    if problem is not None:
        raise ValueError(f"cache entry {key.digest()[:12]} not written: {problem}")
    return out

def check_tensors(key: CacheKey, tensors: Mapping[str, torch.Tensor]) -> str | None:
    """What is wrong with an entry's tensors for `key` (None if nothing). Works on meta tensors too, except
    that `img_shapes` must hold its values."""
    try:
        family = family_of(key)
    except KeyError:
        known = ", ".join(repr(f.cache_name) for f in FAMILIES.values())
        return f"of model family {key.family!r}, which this code does not train ({known})"
    latents = ("target_latents",) + control_names(key.n_controls)
    # a family's own tensors (families.Family.cache_tensors) are, like the embeddings, one mask per prompt
    slots = family.cache_tensors
    expected = set(CACHE_TENSORS) | set(latents) | set(slots) | ({LOSS_MASK} if key.mask_hash else set())
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        return f"missing tensors {missing}" if missing else f"holding unexpected tensors {unexpected}"
    dtype = float_dtype(key.dtype)
    for name in latents + EMBEDDING_TENSORS:
        if tensors[name].dtype != dtype:
            return f"holding {name} of dtype {tensors[name].dtype}, not {dtype}"
    return (_check_embeddings(tensors) or _check_slots(tensors, slots)
            or _check_latents(tensors, latents, family.patch) or _check_loss_mask(tensors))

def _check_loss_mask(tensors: Mapping[str, torch.Tensor]) -> str | None:
    if LOSS_MASK not in tensors:
        return None
    mask, (_, rows, cols) = tensors[LOSS_MASK], tensors["img_shapes"][0].tolist()
    if mask.dtype != torch.float32 or tuple(mask.shape) != (rows * cols,):
        return f"holding {LOSS_MASK} {mask.dtype} {tuple(mask.shape)}, not float32 ({rows * cols},)"
    return None

def _check_embeddings(tensors: Mapping[str, torch.Tensor]) -> str | None:
    prompt, empty = tensors["prompt_embeds"], tensors["empty_prompt_embeds"]
    if prompt.dim() != 2 or empty.dim() != 2:
        return f"holding prompt embeddings of shapes {tuple(prompt.shape)} and {tuple(empty.shape)}, not (S, D)"
    if prompt.shape[1] != empty.shape[1]:
        return f"holding prompt embeddings of widths {prompt.shape[1]} and {empty.shape[1]}"
    return None

def _check_slots(tensors: Mapping[str, torch.Tensor], slots: tuple[str, ...]) -> str | None:
    for name, embeds in zip(slots, EMBEDDING_TENSORS):
        mask, length = tensors[name], tensors[embeds].shape[0]
        if mask.dtype != torch.bool or tuple(mask.shape) != (length,):
            return f"holding {name} {mask.dtype} {tuple(mask.shape)}, not bool ({length},) like {embeds}"
    return None

def _check_latents(tensors: Mapping[str, torch.Tensor], latents: tuple[str, ...], patch: int) -> str | None:
    channels = tensors["target_latents"].shape[0] if tensors["target_latents"].dim() else None
    for name in latents:
        shape = tuple(tensors[name].shape)
        if len(shape) != 4 or shape[1] != 1 or shape[0] != channels:
            return f"holding {name} of shape {shape}, not ({channels}, 1, h, w)"
    shapes = tensors["img_shapes"]
    if shapes.dtype != torch.int64 or tuple(shapes.shape) != (len(latents), 3):
        return f"holding img_shapes {shapes.dtype} {tuple(shapes.shape)}, not int64 ({len(latents)}, 3)"
    # img_shapes is in token units (2x2 latent patches, or latent pixels for 2.1); it must describe the latents.
    expected = [[1, tensors[n].shape[2] // patch, tensors[n].shape[3] // patch] for n in latents]
    if shapes.tolist() != expected:
        return f"holding img_shapes {shapes.tolist()} for latents that pack to {expected}"
    return None
