"""Identities of cache inputs: the sha256 of image files and a short hash of the encoder components."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Mapping

#: Weight files are identified by name and size, every other file by content (see `component_identity`).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".sft")


def hash_file(path: Path, chunk: int = 1 << 20) -> str:
    """sha256 hex of a file's bytes, read in chunks (images can be large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def component_identity(paths: Mapping[str, Path]) -> str:
    """A short stable hash (16 hex) identifying the components that produce cache tensors.

    `paths` maps a component name to a diffusers subfolder (text_encoder/, vae/, tokenizer/, processor/) or
    to a single weight file. Config, tokenizer and processor files are hashed by CONTENT; weight files
    (`WEIGHT_SUFFIXES`) by relative name and SIZE only. Reading gigabytes of weights for every cache run
    would cost far more than the encoding it saves, and a different checkpoint of the same architecture
    ships a different size, file name or config (sharded index). This is the rule DESIGN.md states for the
    cache key. Modification times never count (a copy or `touch` keeps the identity). Hidden files and
    folders are skipped (e.g. the hub's `.cache/` download records, which change on every download). An
    absent path contributes a fixed marker, so a model without e.g. processor/ still has a stable identity.
    """
    digest = hashlib.sha256()
    for name in sorted(paths):
        for line in _identity_lines(name, Path(paths[name])):
            digest.update(line.encode("utf-8") + b"\n")
    return digest.hexdigest()[:16]


def _identity_lines(name: str, path: Path) -> list[str]:
    if not path.exists():
        return [f"{name}:absent"]
    if path.is_file():
        return [f"{name}/{path.name}:{_file_fingerprint(path)}"]
    files = sorted(p for p in path.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
    return [f"{name}/{p.relative_to(path).as_posix()}:{_file_fingerprint(p)}" for p in files]


def _file_fingerprint(path: Path) -> str:
    if path.name.lower().endswith(WEIGHT_SUFFIXES):
        return f"size={path.stat().st_size}"
    return f"sha256={hash_file(path)}"
