"""Content-addressed on-disk embedding cache: one safetensors file per sample.

This module stores, names and validates entries; it never calls a model. The caller passes a function
that computes an entry's tensors on a miss (`samples.encode_example` in this project).

Naming. An entry lives at `root/<digest[:2]>/<digest>.safetensors`, where `digest` is the sha256 of a
`CacheKey`: the sha256 of every image file's bytes (target, then each control), the caption, the identity
of the encoders (`component_identity`), the VAE and VL areas, the target and control buckets, the template
and its prefix length, the dtype, the format version and the sha256 of the pair's mask file (if any).
Entries are therefore shared across runs and datasets (the same image bytes + caption + settings hit), and
any change to a key field makes a new entry.

On-disk format (format version 1).
  Tensors, all contiguous, on the CPU:
    `target_latents`        (C, 1, h, w)   normalized, unpacked VAE latents, key dtype
    `control_latents_{i}`   (C, 1, h_i, w_i) for each control i in 0..n-1, key dtype
    `prompt_embeds`         (S, D)  valid tokens only, key dtype
    `empty_prompt_embeds`   (S0, D) the empty caption with the same control image(s) (caption dropout)
    `img_shapes`            (1 + n, 3) int64, packed units: (1, h // 2, w // 2) of each latent above
    `loss_mask`             (h // 2 * w // 2,) float32, only when the pair has a mask (key field mask_hash):
                            the mask area-averaged onto the target's token grid
  A Qwen-Image-2.1 entry (key field `family`: its family's `cache_name`) has C = 64, `img_shapes` in latent tokens
  ((1, h, w): 2.1 reads latents unpatched) and two more tensors: `prompt_slots` (S,) and `empty_prompt_slots`
  (S0,) bool, True at the vision slots the transformer fills with the controls' (references') latent tokens.
  No mask is stored: only valid tokens are kept, so the mask is rebuilt from the lengths at batching time
  (docs/DESIGN.md, "Contracts"). Metadata: every `CacheKey` field as a string (`CacheKey.to_metadata`),
  `format_version` included, and `tensors_sha256`: the sha256 of every tensor's name, dtype, shape and bytes
  in name order (`tensors_checksum`).

Trust. Reading checks the header, the metadata against the requested key, the tensor names, dtypes, ranks
and `img_shapes`, then the stored bytes against `tensors_sha256` and every value for being finite; a
truncated, damaged (flipped bytes), stale (other key), old-format, unchecksummed, non-finite or incomplete
file is logged, removed and reported as a miss, so it is recomputed and never trusted. Writing goes through
`atomic.save_safetensors`: a temporary name unique per process and call in the entry's folder, fsync, then
`os.replace`, so readers and concurrent writers never see a partial file under an entry's name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import operator
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from safetensors import SafetensorError, safe_open

from qwen_edit_core.common.files import save_safetensors, writing
from qwen_edit_core.data.cache_tensors import (  # noqa: F401 - re-exported: the entry's tensor contract
    CACHE_FORMAT_VERSION, CACHE_TENSORS, EMBEDDING_TENSORS, LOSS_MASK, check_tensors, control_names, float_dtype,
    prepare_tensors)
from qwen_edit_core.data.identity import WEIGHT_SUFFIXES, component_identity, hash_file  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

#: safetensors header dtype names -> torch dtypes (to validate an entry from its header alone).
_HEADER_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                  "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                  "U8": torch.uint8, "BOOL": torch.bool}
CHECKSUM_FIELD = "tensors_sha256"
_STRING_FIELDS = ("caption", "component_identity", "template", "dtype", "mask_hash", "family")
#: key fields that entries written before they existed lack (their default applies)
_OPTIONAL_FIELDS = ("mask_hash", "family")
_INT_FIELDS = ("vae_area", "vl_area", "prefix_len", "format_version")


@dataclass(frozen=True)
class CacheKey:
    """Everything that changes an entry's tensors. `image_hashes`: sha256 of the target file's bytes, then of
    each control file's; buckets are (width, height) in pixels; `template` is the variant's prompt
    encoding (families/variants.py `Variant.encoding`); `dtype` names the float dtype of latents and embeddings."""

    image_hashes: tuple[str, ...]
    caption: str
    component_identity: str
    vae_area: int
    vl_area: int
    target_bucket: tuple[int, int]
    control_buckets: tuple[tuple[int, int], ...]
    template: str
    prefix_len: int
    dtype: str
    format_version: int = CACHE_FORMAT_VERSION
    #: sha256 of the pair's mask file ("" without a mask): the entry then holds `loss_mask`
    mask_hash: str = ""
    #: the model family whose tensor layout the entry holds (its `Family.cache_name`); "" = the 2025 Qwen-Image
    #: family. Part of the digest and checked on read, so an entry of one family is never trained on by another.
    family: str = ""

    def __post_init__(self):
        # Normalize lists (from JSON or a caller) to tuples so equal keys compare and hash equal.
        set_field = object.__setattr__
        if isinstance(self.image_hashes, str):
            raise TypeError("CacheKey.image_hashes must be a sequence of hex digests, not one string")
        set_field(self, "image_hashes", tuple(str(h) for h in self.image_hashes))
        set_field(self, "target_bucket", _pair(self.target_bucket, "target_bucket"))
        set_field(self, "control_buckets", tuple(_pair(b, "control_buckets") for b in self.control_buckets))
        for name in _INT_FIELDS:
            set_field(self, name, _integer(getattr(self, name), name))
        for name in _STRING_FIELDS:
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"CacheKey.{name} must be a str, got {type(getattr(self, name)).__name__}")
        if len(self.image_hashes) != 1 + len(self.control_buckets):
            raise ValueError(f"CacheKey has {len(self.image_hashes)} image hashes for 1 target and "
                             f"{len(self.control_buckets)} control bucket(s)")
        float_dtype(self.dtype)

    @property
    def n_controls(self) -> int:
        return len(self.control_buckets)

    def canonical(self) -> str:
        """A canonical JSON of every field (sorted keys): the text hashed by `digest`. An empty `mask_hash` is
        left out, so entries of pairs without a mask keep the names they had before masks existed; so is an empty
        `family` (the 2025 family's entries keep their names)."""
        fields = dataclasses.asdict(self)
        for name in _OPTIONAL_FIELDS:
            if not fields[name]:
                del fields[name]
        return json.dumps(fields, sort_keys=True, ensure_ascii=False)

    def digest(self) -> str:
        """sha256 hex of `canonical()`: the entry's file name."""
        return hashlib.sha256(self.canonical().encode("utf-8")).hexdigest()

    def to_metadata(self) -> dict[str, str]:
        """One safetensors metadata string per field: strings as they are, the rest as JSON."""
        return {f.name: _field_text(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str]) -> "CacheKey":
        """The key stored by `to_metadata`; ValueError or TypeError if a field is absent or malformed."""
        values = {}
        for f in dataclasses.fields(cls):
            if f.name not in metadata and f.name in _OPTIONAL_FIELDS:
                continue
            if f.name not in metadata:
                raise ValueError(f"cache metadata lacks the key field {f.name!r}")
            text = metadata[f.name]
            values[f.name] = text if f.name in _STRING_FIELDS else json.loads(text)
        return cls(**values)


def _field_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _integer(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"CacheKey.{name} must be an int, got a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"CacheKey.{name} must be an int, got {type(value).__name__}") from None


def _pair(value: Any, name: str) -> tuple[int, int]:
    pair = tuple(_integer(v, name) for v in value)
    if len(pair) != 2:
        raise ValueError(f"CacheKey.{name} entries must be (width, height), got {value!r}")
    return pair


class EmbeddingCache:
    """Entries under `root/<digest[:2]>/<digest>.safetensors`, shared across runs, datasets and processes.

    Counters (`stats()`): `hits` and `misses` of `get` (and so of `get_or_compute`); `recomputed` counts
    entries found damaged, stale or incomplete and removed (they are computed again on the next
    `get_or_compute`).
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        self.hits = self.misses = self.recomputed = 0

    def path_for(self, key: CacheKey) -> Path:
        """Where `key`'s entry lives (the first two hex digits shard the folder)."""
        digest = key.digest()
        return self.root / digest[:2] / f"{digest}.safetensors"

    def get(self, key: CacheKey) -> dict[str, torch.Tensor] | None:
        """The entry's CPU tensors, or None when absent or not trustworthy (then the bad file is removed)."""
        path = self.path_for(key)
        seen = _stat(path)
        if seen is None:
            self.misses += 1
            return None
        tensors, problem = _read(path, key, load=True)
        if problem is not None:
            tensors = None  # release the file's memory map before removing it (Windows refuses otherwise)
            self._reject(path, seen, problem)
            self.misses += 1
            return None
        self.hits += 1
        return tensors

    def contains(self, key: CacheKey, *, verify: bool = True) -> bool:
        """Whether a valid entry exists; a bad entry is removed like in `get`. Counts neither hit nor miss.
        `verify=False` checks the file's header and `img_shapes` alone (no latents or embeddings are read, so
        flipped bytes inside them go unnoticed until `get`)."""
        path = self.path_for(key)
        seen = _stat(path)
        if seen is None:
            return False
        _, problem = _read(path, key, load=verify)
        if problem is not None:
            self._reject(path, seen, problem)
        return problem is None

    def put(self, key: CacheKey, tensors: Mapping[str, torch.Tensor]) -> Path:
        """Validate and write an entry atomically; returns its path. ValueError names what is wrong."""
        return self._write(key, prepare_tensors(key, tensors))

    def get_or_compute(self, key: CacheKey, compute: Callable[[], Mapping[str, torch.Tensor]]
                       ) -> tuple[dict[str, torch.Tensor], bool]:
        """(tensors, hit): the stored entry, or `compute()` written to the cache. A miss returns the tensors
        exactly as stored (CPU, contiguous, key dtype), so a hit and a miss give the same numbers."""
        found = self.get(key)
        if found is not None:
            return found, True
        tensors = prepare_tensors(key, compute())
        self._write(key, tensors)
        return tensors, False

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "recomputed": self.recomputed}

    def _write(self, key: CacheKey, tensors: dict[str, torch.Tensor]) -> Path:
        # Concurrent writers of one key write equal content; each uses its own temporary file and the last
        # rename wins, so the entry's name only ever points at a whole file.
        metadata = {**key.to_metadata(), CHECKSUM_FIELD: tensors_checksum(tensors)}
        path = self.path_for(key)
        # A failed write leaves no file under the entry's name (save_safetensors' temporary file is removed).
        with writing(path, "an embedding cache entry", "The entries already written are kept.", key="cache.dir"):
            save_safetensors(tensors, path, metadata=metadata)
        log.debug("cache: wrote %s", path)
        return path

    def _reject(self, path: Path, seen: os.stat_result, problem: str) -> None:
        log.warning("cache entry %s is %s; removing it, it will be recomputed", path, problem)
        self.recomputed += 1
        try:
            # Another process may have just renamed a good entry over the bad one: remove only what we read.
            if _same_file(_stat(path), seen):
                path.unlink()
        except FileNotFoundError:
            pass
        except OSError as err:
            log.warning("could not remove bad cache entry %s: %s", path, err)


def tensors_checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 hex of every tensor's name, dtype, shape and raw bytes, in name order (CPU tensors)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()


def check_data(tensors: Mapping[str, torch.Tensor], checksum: str | None) -> str | None:
    """What is wrong with an entry's stored values (None if nothing): a checksum that does not match the bytes
    (flipped on disk), or a non-finite value."""
    if checksum is None:
        return f"without a {CHECKSUM_FIELD} checksum (written by an older version)"
    if tensors_checksum(tensors) != checksum:
        return "damaged (its tensor bytes do not match their checksum)"
    for name in sorted(tensors):
        if tensors[name].is_floating_point() and not bool(torch.isfinite(tensors[name]).all()):
            return f"holding non-finite values in {name}"
    return None


def _read(path: Path, key: CacheKey, *, load: bool) -> tuple[dict[str, torch.Tensor] | None, str | None]:
    """(tensors, problem). One `safe_open` (what `safetensors.torch.load_file` does, never torch.load) so the
    metadata and the tensors come from the same file; the key is checked before any tensor is read. With
    `load=False` tensors are meta tensors built from the header (only `img_shapes` is read)."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            metadata = fh.metadata() or {}
            problem = _check_metadata(key, metadata)
            if problem is not None:
                return None, problem
            tensors = {name: _tensor_or_meta(fh, name, load) for name in fh.keys()}
    except (SafetensorError, OSError, RuntimeError, ValueError, KeyError) as err:
        return None, f"unreadable ({type(err).__name__}: {err})"
    problem = check_tensors(key, tensors)
    if problem is None and load:
        problem = check_data(tensors, metadata.get(CHECKSUM_FIELD))
    return (None if problem else tensors), problem


def _tensor_or_meta(fh, name: str, load: bool) -> torch.Tensor:
    if load or name == "img_shapes":
        return fh.get_tensor(name)
    view = fh.get_slice(name)
    dtype = _HEADER_DTYPES.get(view.get_dtype())
    if dtype is None:
        raise ValueError(f"tensor {name} has unsupported dtype {view.get_dtype()}")
    return torch.empty(view.get_shape(), dtype=dtype, device="meta")


def _check_metadata(key: CacheKey, metadata: Mapping[str, str]) -> str | None:
    if metadata.get("format_version") != str(CACHE_FORMAT_VERSION):
        return f"of format {metadata.get('format_version')!r}, not {CACHE_FORMAT_VERSION}"
    try:
        stored = CacheKey.from_metadata(metadata)
    except (ValueError, TypeError) as err:
        return f"carrying unreadable key metadata ({err})"
    if stored != key:
        differing = [f.name for f in dataclasses.fields(key) if getattr(stored, f.name) != getattr(key, f.name)]
        return f"stale (its stored key differs in {differing})"
    return None


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except FileNotFoundError:
        return None


def _same_file(a: os.stat_result | None, b: os.stat_result) -> bool:
    return a is not None and (a.st_ino, a.st_dev, a.st_size, a.st_mtime_ns) == (b.st_ino, b.st_dev, b.st_size,
                                                                               b.st_mtime_ns)
