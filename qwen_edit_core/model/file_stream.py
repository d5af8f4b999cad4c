"""Reading a safetensors file one module at a time, so host memory never holds the whole file converted.

`read_header` gives every tensor as a meta tensor (name, shape, dtype; no data read), which is enough to
detect an architecture and check a state dict. `stream_into` then reads one module's tensors (a weight and
its scales together), converts them (for example scaled fp8 upcast to bf16), moves them to the target device
and assigns them into a model built on the meta device, before reading the next module. Host memory holds
the file's memory-mapped pages and one module's tensors at a time: reading the real transformer's 19 GiB
scaled-fp8 file whole and then upcasting it would need about 57 GiB of host RAM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping

import torch
from safetensors import safe_open

#: safetensors header dtype names -> torch dtypes
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def read_header(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as a meta tensor with its shape and dtype (no data is read)."""
    with safe_open(str(path), framework="pt") as fh:
        out = {}
        for key in fh.keys():
            piece = fh.get_slice(key)
            out[key] = torch.empty(piece.get_shape(), dtype=DTYPES[piece.get_dtype()], device="meta")
        return out


def read_tensors(path: Path, keys) -> dict[str, torch.Tensor]:
    """The named tensors of a safetensors file (for the few small ones a loader needs up front)."""
    with safe_open(str(path), framework="pt") as fh:
        return {key: fh.get_tensor(key) for key in keys}


def module_groups(names: Mapping[str, str]) -> dict[str, list[str]]:
    """File keys grouped by the module their model key belongs to (a weight with its scales)."""
    groups: dict[str, list[str]] = {}
    for file_key, model_key in names.items():
        groups.setdefault(model_key.rpartition(".")[0], []).append(file_key)
    return groups


def stream_into(model: torch.nn.Module, path: Path, names: Mapping[str, str],
                convert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]], device: torch.device) -> None:
    """Fill `model` (parameters on the meta device) from `path`, one module at a time.

    `names` maps the file keys to read to model keys; `convert` turns one module's tensors (model keys) into
    the state-dict entries of that module (it may rename, upcast or quantize them). Each result is moved to
    `device` and assigned in place of the meta tensor (`load_state_dict(assign=True)` on the submodule).
    """
    with safe_open(str(path), framework="pt") as fh:
        for file_keys in module_groups(names).values():
            tensors = convert({names[k]: fh.get_tensor(k) for k in file_keys})
            by_module: dict[str, dict[str, torch.Tensor]] = {}
            for key, value in tensors.items():
                module, _, leaf = key.rpartition(".")
                by_module.setdefault(module, {})[leaf] = value.to(device)
            del tensors
            for module, state in by_module.items():
                model.get_submodule(module).load_state_dict(state, strict=False, assign=True)
