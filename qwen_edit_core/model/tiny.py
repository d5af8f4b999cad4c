"""Offline tiny Qwen-Image-Edit: the embedded default of the demo and the fixture of every test.

`build_tiny` writes a complete diffusers-layout directory (model_index.json, transformer/, vae/,
text_encoder/, tokenizer/, processor/, scheduler/) from nothing: random weights from a seed, a byte-level
BPE tokenizer trained on the pipelines' own templates, Qwen-Image's real scheduler config. diffusers'
`QwenImageEditPipeline` / `QwenImageEditPlusPipeline.from_pretrained` load it offline. The same arguments
give byte-identical files. `transformer_config` also gives the real model's config, for in-memory benchmarks.
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

from qwen_edit_core.families import templates, variants

log = logging.getLogger(__name__)

SIZES = ("tiny", "real-width")

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")

#: Qwen-Image's scheduler (FlowMatchEulerDiscreteScheduler) config, as shipped with the real model.
SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
    "invert_sigmas": False, "max_image_seq_len": 8192, "max_shift": 0.9, "num_train_timesteps": 1000,
    "shift": 1.0, "shift_terminal": 0.02, "stochastic_sampling": False, "time_shift_type": "exponential",
    "use_beta_sigmas": False, "use_dynamic_shifting": True, "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}

# Words a demo or test prompt is likely to use, so prompts are short; anything else falls back to bytes.
_EXTRA_WORDS = ("make turn add remove the a an sky cat dog red green blue purple yellow hat color colour image "
                "picture object from into put blend sharpen brighter darker invert style photo of with and in on "
                "background foreground person face light shadow")


def transformer_config(size: str = "tiny", num_layers: int | None = None) -> dict:
    """The Qwen-Image transformer's config (the default family's `transformer_class`): "tiny" (2 layers, 2x16
    heads), "real-width" (real widths, one block) or "real" (the real 60-block, 20 B-parameter model; build it in
    memory for benchmarks)."""
    if size == "tiny":
        cfg = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
    elif size in ("real-width", "real"):
        cfg = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=1 if size == "real-width" else 60,
                   attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                   axes_dims_rope=(16, 56, 56))
    else:
        raise ValueError(f"unknown size {size!r}; accepted: tiny, real-width, real")
    cfg["guidance_embeds"] = False
    if num_layers is not None:
        cfg["num_layers"] = num_layers
    return cfg


def _text_config(size: str, vocab_size: int, token_ids: dict) -> dict:
    # real-width: the real hidden size (it sets the transformer's joint_attention_dim), heads and key/value
    # heads (28 and 4, as in Qwen2.5-VL-7B) with one layer and a narrow MLP, so the directory stays small;
    # it checks shapes and plumbing, not the 7B encoder's cost.
    hidden, heads, kv_heads, layers, inter = (32, 2, 2, 2, 64) if size == "tiny" else (3584, 28, 4, 1, 1024)
    head_dim = hidden // heads
    # mrope_section splits the head_dim/2 rotary pairs over (time, height, width), 1/4 : 3/8 : 3/8 as in
    # Qwen2.5-VL ([16, 24, 24] for head_dim 128); transformers checks that it sums to head_dim/2.
    time_pairs = head_dim // 8
    space_pairs = head_dim // 2 - time_pairs
    mrope = [time_pairs, space_pairs // 2, space_pairs - space_pairs // 2]
    text = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope},
                bos_token_id=token_ids["<|endoftext|>"], eos_token_id=token_ids["<|im_end|>"])
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                  fullatt_block_indexes=[1])
    return dict(text_config=text, vision_config=vision, image_token_id=token_ids["<|image_pad|>"],
                video_token_id=token_ids["<|video_pad|>"], vision_start_token_id=token_ids["<|vision_start|>"],
                vision_end_token_id=token_ids["<|vision_end|>"], tie_word_embeddings=False)


# -- tokenizer -----------------------------------------------------------------------------------------------
def _train_tokenizer(texts: tuple[str, ...] | None = None):
    """Byte-level BPE trained on the templates until every template word is one token, as in Qwen's vocab
    (so the template prefixes come out at the pipelines' drop counts: 64 and 34). `texts`: another family's
    corpus (families/qwen_image_21/tiny.py), default the 2025 templates.

    Deterministic: the trainer merges until no pair is left inside any pre-token (the Qwen2 regex splits
    the corpus into words), so each word of the corpus ends up whole; `vocab_size` is only a cap well above
    the ~280 merges this takes. Every byte stays in the vocabulary, so any UTF-8 prompt tokenizes.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    special = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
    texts = texts or (templates.EDIT_TEMPLATE, templates.EDIT_PLUS_TEMPLATE, templates.T2I_TEMPLATE,
                      "".join(templates.EDIT_PLUS_IMAGE_PREFIX.format(i) for i in range(1, 4)), _EXTRA_WORDS)
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


def _build_tokenizer(out: Path | None, texts: tuple[str, ...] | None = None):
    from transformers import Qwen2Tokenizer

    vocab, merges = _train_tokenizer(texts)
    # Special tokens right after the BPE vocabulary, in Qwen's order (<|endoftext|>, <|im_start|>, ...):
    # left to the tokenizer, their ids would follow the order in which the constructor registers them.
    vocab.update({token: len(vocab) + i for i, token in enumerate(SPECIAL_TOKENS)})
    # eos/pad as in Qwen2.5-VL's own tokenizer (eos <|im_end|> matches the text config's eos_token_id).
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges],
                               eos_token="<|im_end|>", pad_token="<|endoftext|>",
                               additional_special_tokens=list(SPECIAL_TOKENS[1:]), model_max_length=32768)
    if texts is None:
        _check_prefixes(tokenizer)
    if out is not None:
        tokenizer.save_pretrained(out)
    return tokenizer


def _prompt_encodings() -> dict[str, tuple[str, str, int]]:
    """{encoding: (dropped prefix text, a formatted prompt, tokens dropped)} of every variant's prompt encoding
    (families/variants.py), plus Qwen-Image's text-to-image template as "t2i"."""
    out = {}
    for variant in variants.VARIANTS.values():
        if variant.drop is None:
            continue  # counted by the processor (Qwen-Image-2.1, families/qwen_image_21/tiny.py)
        text, drop = variant.format_prompt("make it blue", 1)
        out.setdefault(variant.encoding, (variant.template.split("{}")[0].split("<|vision_start|>")[0], text, drop))
    out["t2i"] = (templates.T2I_TEMPLATE.split("{}")[0], templates.T2I_TEMPLATE.format("make it blue"),
                  templates.T2I_DROP)
    return out


def prefix_lengths(tokenizer) -> dict[str, int]:
    """Token counts of the template prefixes that the pipelines drop (must be 64, 64 and 34)."""
    return {name: len(tokenizer(prefix)["input_ids"]) for name, (prefix, _, _) in _prompt_encodings().items()}


def _check_prefixes(tokenizer) -> None:
    """Raise unless the pipelines' drop counts cut every template exactly after "<|im_start|>user\n"."""
    encodings = _prompt_encodings()
    got = prefix_lengths(tokenizer)
    want = {name: drop for name, (_, _, drop) in encodings.items()}
    if got != want:
        raise RuntimeError(f"tiny tokenizer splits the template prefixes into {got} tokens, expected {want}")
    # The pipelines drop hidden states of the whole formatted prompt, so check the token right after the cut:
    # it must be the first token of the text after the prefix ("<|vision_start|>", "Picture", "make").
    for name, (prefix, text, drop) in encodings.items():
        expected = tokenizer.convert_ids_to_tokens(tokenizer(text[len(prefix):])["input_ids"][0])
        token = tokenizer.convert_ids_to_tokens(tokenizer(text)["input_ids"][drop])
        if token != expected:
            raise RuntimeError(f"tiny tokenizer: token {drop} of a {name} prompt is {token!r}, expected {expected!r}")


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
