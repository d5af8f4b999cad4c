"""Reading a safetensors file one module at a time, so host memory never holds the whole file converted.

`read_header` gives every tensor as a meta tensor (name, shape, dtype; no data read), which is enough to
detect an architecture and check a state dict. `stream_into` then reads one module's tensors (a weight and
its scales together), converts them (for example scaled fp8 upcast to bf16), moves them to the target device
and assigns them into a model built on the meta device, before reading the next module.

Tensors are read with plain file reads of their byte ranges (the safetensors format: 8 bytes little-endian
header length, a JSON header of `{name: {dtype, shape, data_offsets: [begin, end]}}` relative to the end of the
header, then the data; https://github.com/huggingface/safetensors README "Format"), not by memory-mapping the
file: host memory holds only the module being converted, and the process's resident memory counts only what
the loader allocated (mapped file pages would count too, as long as the kernel keeps them). Reading the real
transformer's scaled-fp8 file whole and then upcasting it needs several times the file in host RAM; streamed to a
GPU it needs one module's tensors (measured: BENCHMARKS.md, "Host memory when loading a single file").
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

#: safetensors header dtype names -> torch dtypes
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_MAX_HEADER = 100 * 2**20  # the safetensors library refuses larger headers too


def read_entries(path: Path) -> tuple[dict[str, dict], int]:
    """({name: header entry}, byte offset of the data) of a safetensors file; `__metadata__` left out.

    Raises ValueError naming the file when the header is truncated, too large or not valid JSON."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError(f"{str(path)!r} is shorter than a safetensors header")
        (size,) = struct.unpack("<Q", raw)
        if size > _MAX_HEADER:
            raise ValueError(f"{str(path)!r}: header of {size} bytes is larger than safetensors allows")
        text = fh.read(size)
    if len(text) != size:
        raise ValueError(f"{str(path)!r}: truncated header ({len(text)} of {size} bytes)")
    entries = json.loads(text)
    entries.pop("__metadata__", None)
    for name, entry in entries.items():
        if entry.get("dtype") not in DTYPES:
            raise ValueError(f"{str(path)!r}: tensor {name!r} has dtype {entry.get('dtype')!r}; readable: "
                             f"{', '.join(DTYPES)}")
    return entries, 8 + size


def read_header(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as a meta tensor with its shape and dtype (no data is read)."""
    entries, _ = read_entries(path)
    return {name: torch.empty(e["shape"], dtype=DTYPES[e["dtype"]], device="meta") for name, e in entries.items()}


def _read_one(fh, entry: dict, start: int, name: str, path) -> torch.Tensor:
    """One tensor read from its byte range into a fresh host tensor."""
    begin, end = entry["data_offsets"]
    dtype = DTYPES[entry["dtype"]]
    count = 1
    for dim in entry["shape"]:
        count *= dim
    if end - begin != count * dtype.itemsize:
        raise ValueError(f"{str(path)!r}: tensor {name!r} spans {end - begin} bytes, its shape {entry['shape']} "
                         f"and dtype {entry['dtype']} need {count * dtype.itemsize}")
    buffer = torch.empty(end - begin, dtype=torch.uint8)
    view, done = memoryview(buffer.numpy()), 0
    fh.seek(start + begin)
    while done < end - begin:  # one read returns at most about 2 GiB on Linux
        got = fh.readinto(view[done:])
        if not got:
            raise ValueError(f"{str(path)!r}: tensor {name!r} is truncated (the file ends inside its data)")
        done += got
    return buffer.view(dtype).reshape(entry["shape"])


def read_tensors(path: Path, keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """The named tensors (all by default) of a safetensors file, each read from its own byte range."""
    entries, start = read_entries(path)
    with open(path, "rb", buffering=0) as fh:
        return {key: _read_one(fh, entries[key], start, key, path) for key in (entries if keys is None else keys)}


def module_groups(names: Mapping[str, str]) -> dict[str, list[str]]:
    """File keys grouped by the module their model key belongs to (a weight with its scales)."""
    groups: dict[str, list[str]] = {}
    for file_key, model_key in names.items():
        groups.setdefault(model_key.rpartition(".")[0], []).append(file_key)
    return groups


def stream_into(model: torch.nn.Module, path: Path, names: Mapping[str, str],
                convert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]], device: torch.device) -> None:
    """Fill `model` (parameters on the meta device) from `path`, one module at a time.

    `names` maps the file keys to read to model keys. One module's tensors are read, moved to `device` as
    stored (fp8 stays one byte a value on the way), then `convert` turns them (model keys) into that module's
    state-dict entries on the device (it may rename, upcast or quantize them: on a GPU that is far faster than
    on the host), which are assigned in place of the meta tensors (`load_state_dict(assign=True)` on the
    submodule). Host memory holds one module's tensors as stored at a time (and their conversions when
    `device` is the CPU).
    """
    entries, start = read_entries(path)
    with open(path, "rb", buffering=0) as fh:
        for file_keys in module_groups(names).values():
            tensors = convert({names[k]: _read_one(fh, entries[k], start, k, path).to(device) for k in file_keys})
            by_module: dict[str, dict[str, torch.Tensor]] = {}
            for key in list(tensors):
                module, _, leaf = key.rpartition(".")
                by_module.setdefault(module, {})[leaf] = tensors.pop(key).to(device)
            for module, state in by_module.items():
                model.get_submodule(module).load_state_dict(state, strict=False, assign=True)


class TensorReader:
    """Tensors spread over one or more safetensors files (a sharded checkpoint's pieces: `where` maps each tensor
    name to its file), each read from its own byte range. Every file's header is read once and the files stay
    open until `close` (or the end of a `with` block)."""

    def __init__(self, where: Mapping[str, Path]):
        self.where = {key: Path(path) for key, path in where.items()}
        self._files: dict[Path, tuple[dict[str, dict], int]] = {}
        self._handles: dict[Path, object] = {}
        for path in sorted(set(self.where.values())):
            entries, start = read_entries(path)
            missing = [k for k, p in self.where.items() if p == path and k not in entries]
            if missing:
                raise ValueError(f"{str(path)!r} lacks tensor(s) {missing[:4]} that its index places there")
            self._files[path] = (entries, start)

    def meta(self) -> dict[str, torch.Tensor]:
        """Every tensor as a meta tensor (shape and dtype; nothing read)."""
        out = {}
        for key, path in self.where.items():
            entry = self._files[path][0][key]
            out[key] = torch.empty(entry["shape"], dtype=DTYPES[entry["dtype"]], device="meta")
        return out

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors, each a fresh host tensor read from its file."""
        out = {}
        for key in keys:
            path = self.where[key]
            if path not in self._handles:
                self._handles[path] = open(path, "rb", buffering=0)
            entries, start = self._files[path]
            out[key] = _read_one(self._handles[path], entries[key], start, key, path)
        return out

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles = {}

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
