"""Offline tiny models: the embedded default of the demo and the fixture of every test.

`build_tiny` writes a complete diffusers-layout directory of any family from nothing, through the family's
`tiny` stage (`write`): random weights from a seed, a byte-level BPE tokenizer trained on the family's own
templates, the family's real scheduler config; its diffusers pipeline loads it offline. The same arguments give
byte-identical files. What is shared by the families lives here: the tokenizer trainer, Qwen's special tokens,
the seeded weight creation and the build's replace-in-place. Each family's `tiny` stage also gives its
transformer's configs (`transformer_config(size, num_layers)`, "real" for in-memory benchmarks) and
`SCHEDULER_CONFIG`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import tempfile
from pathlib import Path

import torch

from qwen_edit_core.families import variants

log = logging.getLogger(__name__)

SIZES = ("tiny", "real-width")

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")

# Words a demo or test prompt is likely to use, so prompts are short; anything else falls back to bytes.
_EXTRA_WORDS = ("make turn add remove the a an sky cat dog red green blue purple yellow hat color colour image "
                "picture object from into put blend sharpen brighter darker invert style photo of with and in on "
                "background foreground person face light shadow")


# -- tokenizer -----------------------------------------------------------------------------------------------
def _train_tokenizer(texts: tuple[str, ...]):
    """Byte-level BPE trained on a family's templates (`texts`, its `tiny` stage's corpus) until every template
    word is one token, as in Qwen's vocab (so the template prefixes come out at the pipelines' drop counts).

    Deterministic: the trainer merges until no pair is left inside any pre-token (the Qwen2 regex splits
    the corpus into words), so each word of the corpus ends up whole; `vocab_size` is only a cap well above
    the ~280 merges this takes. Every byte stays in the vocabulary, so any UTF-8 prompt tokenizes.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    special = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
    corpus = [piece for text in texts for piece in special.split(text.replace("{}", " ")) if piece]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    vocab = dict(sorted(model["vocab"].items(), key=lambda kv: kv[1]))
    return vocab, merges


def _build_tokenizer(out: Path | None, texts: tuple[str, ...], check=None):
    """The tiny Qwen2 tokenizer trained on `texts`; `check(tokenizer)` (the family's prefix check) runs before it
    is saved to `out` (None: not saved)."""
    from transformers import Qwen2Tokenizer

    vocab, merges = _train_tokenizer(texts)
    # Special tokens right after the BPE vocabulary, in Qwen's order (<|endoftext|>, <|im_start|>, ...):
    # left to the tokenizer, their ids would follow the order in which the constructor registers them.
    vocab.update({token: len(vocab) + i for i, token in enumerate(SPECIAL_TOKENS)})
    # eos/pad as in Qwen2.5-VL's own tokenizer (eos <|im_end|> matches the text config's eos_token_id).
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges],
                               eos_token="<|im_end|>", pad_token="<|endoftext|>",
                               additional_special_tokens=list(SPECIAL_TOKENS[1:]), model_max_length=32768)
    if check is not None:
        check(tokenizer)
    if out is not None:
        tokenizer.save_pretrained(out)
    return tokenizer


# -- the directory -------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _isolated_init(seed: int):
    """Seeded float32 CPU weight creation that leaves the caller's RNG, default dtype/device and
    transformers' progress bars as they were (ComfyUI runs nodes under inference mode: weights made there
    could not be trained later)."""
    from transformers.utils import logging as hf_logging

    dtype, bars = torch.get_default_dtype(), hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" bars on every save
    try:
        with torch.random.fork_rng(devices=[]), torch.inference_mode(False), torch.device("cpu"):
            torch.set_default_dtype(torch.float32)
            torch.manual_seed(seed)
            yield
    finally:
        torch.set_default_dtype(dtype)
        if bars:
            hf_logging.enable_progress_bar()


def _check_replaceable(out: Path) -> None:
    # A previous build (or an empty folder) may be replaced; anything else is the user's and is kept.
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "model_index.json").is_file():
        raise FileExistsError(f"refusing to replace {out}: it is not empty and holds no model_index.json")


def build_tiny(out_dir, variant: str = variants.DEFAULT, seed: int = 0, size: str = "tiny",
               transformer_overrides: dict | None = None) -> Path:
    """Write a complete tiny Qwen-Image-Edit directory (diffusers layout) to `out_dir`; returns its path.

    `variant` a families/variants.py name (the pipeline class in model_index.json, and `zero_cond_t` in the
    transformer config where the variant has it); `size` "tiny" or "real-width"; `transformer_overrides` are
    merged into the transformer config (e.g. {"zero_cond_t": True}).
    The same arguments give byte-identical files. Each component is seeded from `seed` on its own, so the
    VAE and transformer weights do not depend on the tokenizer's vocabulary or the encoder's size. The
    directory is built beside `out_dir` and renamed into place; an existing `out_dir` is replaced only if
    it is empty or a previous build. The caller's global RNG state is left as it was.
    """
    spec = variants.get(variant)
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; accepted: {', '.join(SIZES)}")
    out = Path(out_dir)
    _check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    overrides = {**({"zero_cond_t": True} if spec.zero_cond_t else {}), **(transformer_overrides or {})}
    try:
        spec.family.stage("tiny").write(tmp, spec, seed, size, overrides)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            out.rename(old / "dir")
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("built tiny %s model (%s, seed %d) in %s", variant, size, seed, out)
    return out
