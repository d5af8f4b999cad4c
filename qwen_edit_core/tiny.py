"""Offline tiny Qwen-Image-Edit: the embedded default of the demo and the fixture of every test.

`build_tiny` writes a complete diffusers-layout directory (model_index.json, transformer/, vae/,
text_encoder/, tokenizer/, processor/, scheduler/) from nothing: random weights from a seed, a byte-level
BPE tokenizer trained on the pipelines' own templates, Qwen-Image's real scheduler config. diffusers'
`QwenImageEditPipeline.from_pretrained` loads it offline. The same seed gives byte-identical files.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import torch

from . import templates

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
    """QwenImageTransformer2DModel config: "tiny" (2 layers, 2x16 heads), "real-width" (real widths, one
    block) or "real" (the real 60-block, 20 B-parameter model; build it in memory for benchmarks)."""
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
    # real-width: the real hidden size (it sets the transformer's joint_attention_dim) with one layer and a
    # narrow MLP, so the directory stays small; it checks shapes and plumbing, not the 7B encoder's cost.
    hidden, heads, layers, inter = (32, 2, 2, 64) if size == "tiny" else (3584, 28, 1, 1024)
    head_dim = hidden // heads
    # mrope_section splits head_dim/2 rotary pairs over (time, height, width).
    third = head_dim // 2 // 4
    mrope = [third, (head_dim // 2 - third) // 2, head_dim // 2 - third - (head_dim // 2 - third) // 2]
    text = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope},
                bos_token_id=token_ids["<|endoftext|>"], eos_token_id=token_ids["<|im_end|>"])
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                  fullatt_block_indexes=[1])
    return dict(text_config=text, vision_config=vision, image_token_id=token_ids["<|image_pad|>"],
                video_token_id=token_ids["<|video_pad|>"], vision_start_token_id=token_ids["<|vision_start|>"],
                vision_end_token_id=token_ids["<|vision_end|>"], tie_word_embeddings=False)


# -- tokenizer -----------------------------------------------------------------------------------------------
def _train_tokenizer():
    """Byte-level BPE trained on the templates until every template word is one token, as in Qwen's vocab
    (so the template prefixes come out at the pipelines' drop counts: 64 and 34)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    special = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
    texts = [templates.EDIT_TEMPLATE, templates.EDIT_PLUS_TEMPLATE, templates.T2I_TEMPLATE,
             "".join(templates.EDIT_PLUS_IMAGE_PREFIX.format(i) for i in range(1, 4)), _EXTRA_WORDS]
    corpus = [piece for text in texts for piece in special.split(text.replace("{}", " ")) if piece]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 4, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    vocab = dict(sorted(model["vocab"].items(), key=lambda kv: kv[1]))
    return vocab, merges


def _build_tokenizer(out: Path):
    from transformers import Qwen2Tokenizer

    vocab, merges = _train_tokenizer()
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges],
                               additional_special_tokens=list(SPECIAL_TOKENS[1:]), model_max_length=32768)
    _check_prefixes(tokenizer)
    tokenizer.save_pretrained(out)
    return tokenizer


def prefix_lengths(tokenizer) -> dict[str, int]:
    """Token counts of the template prefixes that the pipelines drop (must be 64, 64 and 34)."""
    edit_prefix = templates.EDIT_TEMPLATE.split("<|vision_start|>")[0]
    plus_prefix = templates.EDIT_PLUS_TEMPLATE.split("{}")[0]
    t2i_prefix = templates.T2I_TEMPLATE.split("{}")[0]
    count = lambda text: len(tokenizer(text)["input_ids"])  # noqa: E731
    return {"edit": count(edit_prefix), "edit-plus": count(plus_prefix), "t2i": count(t2i_prefix)}


def _check_prefixes(tokenizer) -> None:
    got = prefix_lengths(tokenizer)
    want = {"edit": templates.EDIT_DROP, "edit-plus": templates.EDIT_PLUS_DROP, "t2i": templates.T2I_DROP}
    if got != want:
        raise RuntimeError(f"tiny tokenizer splits the template prefixes into {got} tokens, expected {want}")
    ids = tokenizer(templates.EDIT_TEMPLATE.format("x"))["input_ids"]
    if ids[templates.EDIT_DROP] != tokenizer.convert_tokens_to_ids("<|vision_start|>"):
        raise RuntimeError("tiny tokenizer: token 64 of an Edit prompt is not <|vision_start|>")


# -- the directory -------------------------------------------------------------------------------------------
def build_tiny(out_dir, variant: str = "edit", seed: int = 0, size: str = "tiny",
               transformer_overrides: dict | None = None) -> Path:
    """Write a complete tiny Qwen-Image-Edit directory (diffusers layout) to `out_dir`; returns its path.

    `variant` "edit" or "edit-plus" (the pipeline class in model_index.json); `size` "tiny" or "real-width";
    `transformer_overrides` are merged into the transformer config (e.g. {"zero_cond_t": True}).
    The caller's global RNG state is left as it was.
    """
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor,
                              Qwen2VLProcessor, Qwen2VLVideoProcessor)

    if variant not in templates.VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; accepted: {', '.join(templates.VARIANTS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; accepted: {', '.join(SIZES)}")
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tokenizer = _build_tokenizer(out / "tokenizer")
    token_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    # The VL sees small images: at most 56*56 pixels = 4 merged image tokens.
    image_processor = Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=2,
                                            temporal_patch_size=2)
    video_processor = Qwen2VLVideoProcessor(min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=2,
                                            temporal_patch_size=2)
    Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                     video_processor=video_processor).save_pretrained(out / "processor")
    FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER_CONFIG).save_pretrained(out / "scheduler")

    with torch.random.fork_rng(devices=[]), torch.inference_mode(False):
        torch.manual_seed(seed)
        te_config = Qwen2_5_VLConfig(**_text_config(size, len(tokenizer), token_ids))
        Qwen2_5_VLForConditionalGeneration(te_config).save_pretrained(out / "text_encoder")
        vae = AutoencoderKLQwenImage(base_dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                     attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0,
                                     latents_mean=[round(-0.3 + 0.04 * i, 4) for i in range(16)],
                                     latents_std=[round(1.5 + 0.07 * i, 4) for i in range(16)])
        vae.save_pretrained(out / "vae")
        cfg = {**transformer_config(size), **(transformer_overrides or {})}
        QwenImageTransformer2DModel(**cfg).save_pretrained(out / "transformer")

    pipeline = "QwenImageEditPipeline" if variant == "edit" else "QwenImageEditPlusPipeline"
    index = {"_class_name": pipeline, "_diffusers_version": "0.42.1",
             "processor": ["transformers", "Qwen2VLProcessor"],
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
             "tokenizer": ["transformers", "Qwen2Tokenizer"],
             "transformer": ["diffusers", "QwenImageTransformer2DModel"],
             "vae": ["diffusers", "AutoencoderKLQwenImage"]}
    (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    log.info("built tiny %s model (%s, seed %d) in %s", variant, size, seed, out)
    return out
