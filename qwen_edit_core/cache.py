"""Content-addressed on-disk embedding cache: one safetensors file per sample.

An entry's name is the sha256 of its key: the bytes of every image, the caption, the identity of the
encoders, the areas and buckets, the template and prefix length, the dtype and the format version. The key
is also stored as metadata and checked on read, so a renamed, stale, truncated or damaged file is detected,
removed and recomputed, never trusted. Writes go to a unique temporary name and are renamed into place.

Tensors of an entry: `target_latents` (16, 1, h, w), `control_latents_{i}` (16, 1, h_i, w_i) normalized
latents; `prompt_embeds` (S, D) and `empty_prompt_embeds` (S0, D) hold valid tokens only (the padding mask
is rebuilt at batching time from the lengths); `img_shapes` (1 + n, 3) int64 in packed units.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .atomic import save_safetensors

log = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1
REQUIRED_TENSORS = ("target_latents", "prompt_embeds", "empty_prompt_embeds", "img_shapes")


@dataclass(frozen=True)
class CacheKey:
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

    def canonical(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, ensure_ascii=False)

    def digest(self) -> str:
        return hashlib.sha256(self.canonical().encode("utf-8")).hexdigest()

    def to_metadata(self) -> dict[str, str]:
        return {"key": self.canonical(), "format_version": str(self.format_version)}


def hash_file(path: Path, chunk: int = 1 << 20) -> str:
    """sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def component_identity(paths: Mapping[str, Path]) -> str:
    """A short stable hash of components: each config/tokenizer file's content, and each weight file's name
    and size. Weights are not read (they are gigabytes); a retrained model of the same shapes should ship a
    changed config or file name, and DESIGN.md states this rule."""
    digest = hashlib.sha256()
    for name in sorted(paths):
        path = Path(paths[name])
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            rel = f"{name}/{file.relative_to(path) if path.is_dir() else file.name}"
            if file.suffix in (".safetensors", ".bin", ".pt", ".gguf"):
                digest.update(f"{rel}:{file.stat().st_size}\n".encode())
            else:
                digest.update(f"{rel}:{hashlib.sha256(file.read_bytes()).hexdigest()}\n".encode())
    return digest.hexdigest()[:16]


class EmbeddingCache:
    """Entries under `root/<digest[:2]>/<digest>.safetensors`, shared across runs and datasets."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.hits = self.misses = self.recomputed = 0

    def path_for(self, key: CacheKey) -> Path:
        digest = key.digest()
        return self.root / digest[:2] / f"{digest}.safetensors"

    def get(self, key: CacheKey) -> dict[str, torch.Tensor] | None:
        """The entry's tensors, or None if absent or not trustworthy (then the bad file is removed)."""
        path = self.path_for(key)
        if not path.is_file():
            return None
        problem = None
        try:
            from safetensors import safe_open
            with safe_open(str(path), framework="pt") as fh:
                metadata = fh.metadata() or {}
            tensors = load_file(path, device="cpu")
        except (SafetensorError, OSError, RuntimeError, ValueError) as err:
            problem, tensors, metadata = f"unreadable ({err})", None, {}
        if problem is None:
            problem = _check(key, metadata, tensors)
        if problem is not None:
            log.warning("cache entry %s is %s; recomputing it", path, problem)
            path.unlink(missing_ok=True)
            self.recomputed += 1
            return None
        return tensors

    def put(self, key: CacheKey, tensors: Mapping[str, torch.Tensor]) -> Path:
        """Write an entry atomically (unique temporary file, fsync, rename)."""
        missing = [n for n in REQUIRED_TENSORS if n not in tensors]
        if missing:
            raise ValueError(f"cache entry is missing tensors {missing}")
        return save_safetensors(tensors, self.path_for(key), metadata=key.to_metadata())

    def get_or_compute(self, key: CacheKey,
                       compute: Callable[[], Mapping[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], bool]:
        """(tensors, hit): the stored entry, or `compute()` written to the cache."""
        found = self.get(key)
        if found is not None:
            self.hits += 1
            return found, True
        self.misses += 1
        tensors = dict(compute())
        self.put(key, tensors)
        return tensors, False

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "recomputed": self.recomputed}


def _check(key: CacheKey, metadata: Mapping[str, str], tensors: Mapping[str, torch.Tensor]) -> str | None:
    if metadata.get("format_version") != str(CACHE_FORMAT_VERSION):
        return f"of format {metadata.get('format_version')!r}, not {CACHE_FORMAT_VERSION}"
    if metadata.get("key") != key.canonical():
        return "stale (its stored key differs from the requested one)"
    missing = [n for n in REQUIRED_TENSORS if n not in tensors]
    n_controls = len(key.control_buckets)
    missing += [f"control_latents_{i}" for i in range(n_controls) if f"control_latents_{i}" not in tensors]
    if missing:
        return f"missing tensors {missing}"
    shapes = tensors["img_shapes"]
    if shapes.dtype != torch.int64 or tuple(shapes.shape) != (1 + n_controls, 3):
        return f"holding img_shapes {tuple(shapes.shape)} for {n_controls} control(s)"
    for name in ("prompt_embeds", "empty_prompt_embeds"):
        if tensors[name].dim() != 2:
            return f"holding {name} of rank {tensors[name].dim()}, not 2"
    for name in ["target_latents"] + [f"control_latents_{i}" for i in range(n_controls)]:
        if tensors[name].dim() != 4:
            return f"holding {name} of rank {tensors[name].dim()}, not 4"
    return None
