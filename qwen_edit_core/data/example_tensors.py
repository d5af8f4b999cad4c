"""One training sample's tensors: encode an EditExample exactly as the sampler would see it.

The cache stage and realtime training both call `encode_example`, so a cached batch and a realtime batch
hold the same numbers and give the same loss. `build_cache` is the cache stage: it loads nothing itself,
takes the encoders it is given, and skips entries already on disk.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from qwen_edit_core.model import encode

from qwen_edit_core.families import variants
from qwen_edit_core.data.cache import CacheKey, EmbeddingCache, component_identity, hash_file
from qwen_edit_core.data.dataset import EditExample
from qwen_edit_core.common.progress import CancelToken, Progress, ProgressFn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncodeSettings:
    """The inputs of encoding that change the tensors (all of them are part of the cache key)."""

    variant: str
    vae_area: int
    vl_area: int
    dtype: torch.dtype
    convert_modes: bool = False
    #: "pipeline": each control at its own size at the VAE area (as the pipelines); "target": every control
    #: resized to exactly the target's bucket (pixel-aligned pairs)
    control_size: str = "pipeline"

    @property
    def prefix_len(self) -> int:
        """Template tokens dropped from the embeddings; 0 where the processor counts them (Qwen-Image-2.1: its
        system turn, which the processor's files, part of the encoder identity, decide)."""
        return variants.get(self.variant).drop or 0

    @property
    def family(self):
        """The variant's model family (families/family.py)."""
        return variants.get(self.variant).family


def buckets(example: EditExample, settings: EncodeSettings) -> tuple[tuple[int, int], tuple[tuple[int, int], ...]]:
    """(target bucket, control buckets) as (width, height) at the VAE area."""
    def at(size):
        return encode.calculate_dimensions(settings.vae_area, size[0] / size[1])
    target = at(example.target_size)
    if settings.control_size == "target":
        return target, (target,) * len(example.control_sizes)
    return target, tuple(at(s) for s in example.control_sizes)


#: per-image resize lines logged at INFO before the rest go to DEBUG (a summary line says how many)
RESIZE_LINES_AT_INFO = 20


def log_resizes(examples: Sequence[EditExample], settings: EncodeSettings) -> int:
    """Log each image training resizes, with its size and the bucket it trains at (the VAE area's
    `calculate_dimensions`, or the target's bucket for every control with `control_size: target`); returns how
    many images are resized. Called once per run: the first RESIZE_LINES_AT_INFO lines at INFO, the rest at
    DEBUG, then a count at INFO, so a large dataset does not flood the log."""
    resized = 0
    for ex in examples:
        target, controls = buckets(ex, settings)
        pairs = [("target", ex.target_size, target)] + [
            (f"control {i}", size, bucket) for i, (size, bucket) in enumerate(zip(ex.control_sizes, controls))]
        for what, size, bucket in pairs:
            if tuple(size) == tuple(bucket):
                continue
            level = logging.INFO if resized < RESIZE_LINES_AT_INFO else logging.DEBUG
            log.log(level, "training resizes %s %s %dx%d to %dx%d (data.vae_area=%d, data.control_size=%s)",
                    ex.name, what, *size, *bucket, settings.vae_area, settings.control_size)
            resized += 1
    if resized:
        log.info("training resizes %d image(s) of %d examples to their buckets (sizes above%s)", resized,
                 len(examples), "; the rest at DEBUG" if resized > RESIZE_LINES_AT_INFO else "")
    return resized


def cache_key(example: EditExample, settings: EncodeSettings, identity: str) -> CacheKey:
    target_bucket, control_buckets = buckets(example, settings)
    return CacheKey(image_hashes=tuple(hash_file(p) for p in (example.target, *example.controls)),
                    caption=example.caption, component_identity=identity, vae_area=settings.vae_area,
                    vl_area=variants.get(settings.variant).vl_area_key(settings.vl_area),
                    target_bucket=target_bucket, control_buckets=control_buckets,
                    template=variants.get(settings.variant).encoding,
                    prefix_len=settings.prefix_len, dtype=str(settings.dtype).removeprefix("torch."),
                    mask_hash=hash_file(example.mask) if example.mask is not None else "",
                    family=settings.family.cache_name)


def encoder_identity(model_dir, vae_file=None, text_encoder_file=None, processor_dir=None) -> str:
    """Identity of the components that produce cache tensors (text encoder, processor, tokenizer, VAE). The VAE
    and the text encoder may be single files and the processor another folder (ComfyUI's bundled tokenizer); a
    model directory's own subfolders give the same identity as before these existed."""
    paths = {name: model_dir / name for name in ("text_encoder", "tokenizer", "processor", "vae")}
    for name, path in (("vae", vae_file), ("text_encoder", text_encoder_file), ("processor", processor_dir)):
        if path:
            paths[name] = Path(path)
    return component_identity(paths)


def encode_example(components, example: EditExample, settings: EncodeSettings) -> dict[str, torch.Tensor]:
    """The cache tensors of one example, on the CPU in `settings.dtype`: its family's `encode_example`
    (families/<family>/example_tensors.py), which encodes it exactly as that family's sampler does. A pair with a
    mask adds `loss_mask`: the mask area-averaged onto the target's token grid (float32)."""
    return settings.family.stage("example_tensors").encode_example(components, example, settings)


def build_cache(components, examples: Sequence[EditExample], cache: EmbeddingCache, settings: EncodeSettings, *,
                identity: str, progress: ProgressFn | None = None,
                cancel: CancelToken | None = None) -> dict[str, int]:
    """Compute every missing entry (keys use the encoders' `identity`); returns {"total", "hits", "computed"}."""
    hits = 0
    for i, example in enumerate(examples):
        if cancel is not None:
            cancel.check()
        _, hit = cache.get_or_compute(cache_key(example, settings, identity),
                                      lambda ex=example: encode_example(components, ex, settings))
        hits += int(hit)
        if progress is not None:
            progress(Progress("cache", i + 1, len(examples)))
    log.info("cache: %d entries, %d reused, %d computed (%s)", len(examples), hits, len(examples) - hits, cache.root)
    return {"total": len(examples), "hits": hits, "computed": len(examples) - hits}
