"""Checking model weight files before anything loads: every safetensors file a component would read (a diffusers
directory's transformer/, vae/, text_encoder/ with their sharded indexes, or ComfyUI single files) is read as a
header only (file_stream.read_entries: a few kilobytes, no tensor data) and checked against its own size and,
for the transformer and the VAE of a diffusers directory, against the tensors the model of its config.json
needs (a meta-device model: no weights, no memory).

Why our own check: a damaged file reaches the libraries' loaders as a bare error (safetensors' "HeaderTooLarge"
or "incomplete metadata"), and a file with a valid header but missing tensors loads "successfully" into a model
whose missing weights stay on the meta device, failing later with "Cannot copy out of meta tensor". The checks
are those the LoRA reader already applies to LoRA files (a readable header, every tensor's bytes inside the
file), plus what a model needs: every tensor present, each of the config's shape. Each message names the file,
the problem and what to do.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable, Mapping

from qwen_edit_core.model import file_stream

#: what to do about a damaged or incomplete file
REDOWNLOAD = "download the file again (it is damaged or was cut short), or point to an intact copy"


class ModelNotFoundError(FileNotFoundError):
    """A model directory, file or hub id that is not available offline; the message says what to do."""


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def require_safetensors(folder: Path, component: str) -> None:
    """ModelNotFoundError when `folder` holds pickle weights (.bin, ...) but no .safetensors: only safetensors
    are read from model directories (`use_safetensors=True`)."""
    folder = Path(folder)
    if not folder.is_dir() or any(folder.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ModelNotFoundError(
            f"{component}: {str(folder)!r} holds only pickle-based weights ({', '.join(pickles[:3])}), which are "
            "never loaded (they can run code); convert them once where you trust the file, e.g. "
            "`model.save_pretrained(folder, safe_serialization=True)` in diffusers/transformers, or download the "
            "safetensors release of the model")


class WeightFileError(ValueError):
    """A weight file that cannot be what its loader expects; the message names the file, the problem and the
    fix."""


def header_problems(path: Path) -> tuple[dict[str, dict], list[str]]:
    """({tensor name: header entry}, problems) of one safetensors file: unreadable or oversized header, no
    tensors, a dtype we do not read, a tensor whose byte range does not match its dtype and shape, or data
    running past the end of the file (a truncated download)."""
    path = Path(path)
    size = path.stat().st_size
    try:
        entries, start = file_stream.read_entries(path)
    except Exception as err:  # noqa: BLE001 - a damaged header makes the JSON reader raise several types
        claimed = _claimed_header(path)
        if claimed is not None and claimed > size:
            return {}, [f"its header claims {claimed} bytes but the file has {size}"]
        return {}, [f"its header is not readable ({str(err).replace(repr(str(path)) + ': ', '')})"]
    if not entries:
        return entries, ["it holds no tensors (a valid header with nothing in it)"]
    problems, end = [], 0
    for name, entry in entries.items():
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) for n in offsets)):
            problems.append(f"tensor {name!r} has a malformed header entry {json.dumps(entry)[:120]}")
            continue
        need = math.prod(shape) * file_stream.DTYPES[entry["dtype"]].itemsize
        if offsets[1] - offsets[0] != need or offsets[0] < 0:
            problems.append(f"tensor {name!r} ({entry['dtype']} {shape}) needs {need} bytes but its header gives "
                            f"bytes {offsets[0]} to {offsets[1]}")
        end = max(end, offsets[1])
    if start + end > size:
        problems.append(f"it is truncated: its tensors need {start + end} bytes, the file has {size}")
    return entries, problems[:4] + ([f"and {len(problems) - 4} more"] if len(problems) > 4 else [])


def _claimed_header(path: Path) -> int | None:
    """The header length the file's first 8 bytes claim (little-endian), or None for a shorter file."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
    return int.from_bytes(raw, "little") if len(raw) == 8 else None


def check_file(path: Path, what: str) -> dict[str, dict]:
    """The header entries of `path` (the `what` file of a component), or WeightFileError naming every problem."""
    path = Path(path)
    if not path.is_file():
        raise WeightFileError(f"{what} file {str(path)!r} does not exist; {REDOWNLOAD}")
    entries, problems = header_problems(path)
    if problems:
        raise WeightFileError(f"{what} file {str(path)!r} is damaged: {'; '.join(problems)}. {REDOWNLOAD}")
    return entries


def folder_files(folder: Path, what: str) -> tuple[dict[str, dict], list[Path]]:
    """(every tensor's header entry, the files read) of a diffusers component folder: its single file or the
    shards its `*.safetensors.index.json` lists; each file checked, and each tensor an index names found in its
    shard."""
    folder = Path(folder)
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if not indexes:
        found: dict[str, dict] = {}
        paths = sorted(folder.glob("*.safetensors"))
        for path in paths:
            found.update(check_file(path, what))
        return found, paths
    try:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as err:
        raise WeightFileError(f"{what} index {str(indexes[0])!r} is not a readable shard index ({err}); "
                              f"{REDOWNLOAD}") from None
    found, shards = {}, sorted(set(weight_map.values()))
    for shard in shards:
        entries = check_file(folder / shard, f"{what} shard")
        listed = [k for k, v in weight_map.items() if v == shard and k not in entries]
        if listed:
            raise WeightFileError(f"{what} shard {str(folder / shard)!r} lacks {len(listed)} tensor(s) its index "
                                  f"{indexes[0].name} lists (e.g. {listed[:3]}); {REDOWNLOAD}")
        found.update(entries)
    return found, [folder / shard for shard in shards]


def check_complete(entries: Mapping[str, dict], expected: Mapping[str, tuple[int, ...]], what: str,
                   where: Path) -> None:
    """WeightFileError when a tensor the model needs (`expected`: name -> shape, from its config) is missing
    from `entries` or has another shape; extra tensors are left to the loader."""
    missing = [k for k in expected if k not in entries]
    wrong = [f"{k} is {entries[k]['shape']}, the config needs {list(expected[k])}" for k in expected
             if k in entries and list(entries[k]["shape"]) != list(expected[k])]
    problems = ([f"{len(missing)} tensor(s) the model needs are missing (e.g. {missing[:3]})"] if missing else []) \
        + ([f"{len(wrong)} tensor(s) have another shape than its config.json gives ({'; '.join(wrong[:3])})"]
           if wrong else [])
    if problems:
        raise WeightFileError(f"{what} {str(where)!r} does not match its config.json: {'; '.join(problems)}. "
                              f"{REDOWNLOAD}, or use the config.json that came with the weights")


def meta_shapes(component: str, folder: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} the diffusers model of `folder/config.json` needs (transformer or vae), built on the
    meta device: no weights, no memory."""
    import diffusers
    from accelerate import init_empty_weights

    from qwen_edit_core.families import DEFAULT
    default = DEFAULT.class_of(component)
    config = default.load_config(folder)
    # the class config.json names (each family has its own transformer and VAE classes)
    cls = getattr(diffusers, config.get("_class_name", ""), None) or default
    with init_empty_weights():
        model = cls.from_config(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_model_files(model_dir: Path | None, which: Iterable[str], files: Mapping[str, Path | None]) -> None:
    """Check every weight file the components `which` would load: `files[component]` (a single file) when given,
    else the model directory's component folder; the transformer's and the VAE's folders also against their
    config.json. WeightFileError names the first damaged file."""
    for component in which:
        single = files.get(component)
        if single:
            if Path(single).is_file():  # a missing file is reported by its loader, naming its config key
                check_file(Path(single), component)
            continue
        folder = Path(model_dir) / component if model_dir is not None else None
        if folder is None or not folder.is_dir():
            continue  # the loader says what is missing
        entries, paths = folder_files(folder, component)
        if entries and component in ("transformer", "vae") and (folder / "config.json").is_file():
            check_complete(entries, meta_shapes(component, folder), component, paths[0] if len(paths) == 1 else folder)
