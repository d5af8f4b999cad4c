"""The text encoder as one safetensors file (ComfyUI's text_encoders/qwen_2.5_vl_7b*.safetensors, bf16/fp32 or
scaled fp8) and the tokenizer/processor from ComfyUI's bundled Qwen2.5 tokenizer files.

The safetensors reading, quantization checks and fp8 dequantization are shared with the transformer and VAE
files (model/single_file.py); the key layout below is learned from ComfyUI's source, as noted.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from qwen_edit_core.common.names import rename
from qwen_edit_core.model import file_stream
from qwen_edit_core.model.single_file import (_DROP_SUFFIXES, ARCHITECTURES, SingleFileError, _read_tensors,
                                              check_quant_formats, check_state_dict, checked_header, dequantize)

log = logging.getLogger(__name__)

# ComfyUI's qwen_2.5_vl_7b*.safetensors (models/text_encoders) is Qwen2.5-VL-7B in the original Hugging Face
# checkpoint layout. Learned from ComfyUI's source (Comfy-Org/ComfyUI a125cd84, 0.3.64) and checked there by
# building its module on the meta device and comparing every key and shape with ours:
# - comfy/text_encoders/llama.py `Qwen25_7BVLI`: the language model is `model.` (Llama2_: `embed_tokens`,
#   `layers.N.self_attn.{q,k,v,o}_proj` with q/k/v biases, `layers.N.mlp.{gate,up,down}_proj`,
#   `layers.N.{input,post_attention}_layernorm`, `norm`); `lm_head` is not built (commented out there), so a file
#   may or may not carry `lm_head.weight`; the vision tower is `visual.`.
# - comfy/text_encoders/qwen_vl.py `Qwen2VLVisionTransformer`: `visual.patch_embed.proj` (Conv3d),
#   `visual.blocks.N.{norm1,norm2}`, `.attn.{qkv,proj}`, `.mlp.{gate,up,down}_proj`, `visual.merger.ln_q`,
#   `visual.merger.mlp.{0,2}`.
# - comfy/sd1_clip.py SDClipModel.load_sd loads a text_encoders file into that module as it is (no prefix);
#   comfy/sd.py detect_te_model calls a file with `model.layers.0.self_attn.k_proj.bias` of 512 values QWEN25_7B.
# - Scaled fp8: comfy/text_encoders/hunyuan_video.py llama_detect reads the weight dtype from `model.norm.weight`
#   and a `scaled_fp8` key (an empty tensor of the fp8 dtype, comfy/sd1_clip.py) marks the layout; comfy/ops.py
#   scaled_fp8_ops gives every Linear (358 in the 7B, language model and vision tower) a 0-d float32
#   `.scale_weight`, weight = fp8 * scale_weight, and an optional `.scale_input` (activations only, dropped here).
#   Biases, norms, embeddings and the patch-embedding conv carry no scale (ComfyUI casts them as they are; a
#   bias stored in fp8 is upcast without a scale, as there). Newer files use `.weight_scale` + `.comfy_quant`
#   instead; both are handled by `dequantize` above.
# - Prefixes: a full checkpoint (comfy/supported_models.py QwenImage.clip_target) keeps the encoder under
#   `text_encoders.qwen25_7b.transformer.`; ComfyUI's CLIPSave node (comfy_extras/nodes_model_merging.py) writes
#   `qwen25_7b.transformer.` (plus `qwen25_7b.logit_scale`, unused). Keys outside the prefix are ignored.
# transformers 5 names the same modules `model.language_model.*` and `model.visual.*`
# (transformers/models/qwen2_5_vl/modeling_qwen2_5_vl.py, Qwen2_5_VLModel), `lm_head` unchanged.
TE_PREFIXES = ("text_encoders.qwen25_7b.transformer.", "qwen25_7b.transformer.")
#: (file prefix, transformers 5 prefix); files already in transformers 5 names pass unchanged
TE_RENAMES = (("model.language_model.", "model.language_model."), ("model.visual.", "model.visual."),
              ("model.", "model.language_model."), ("visual.", "model.visual."), ("lm_head.", "lm_head."))
#: beside the transformers' (model/architectures/, the package data)
TE_ARCHITECTURES = ARCHITECTURES.with_name("text_encoder_architectures.json")
#: the tokens whose ids the model config must share with the tokenizer
TE_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
             "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}


def read_text_encoder_state_dict(path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors with transformers 5 Qwen2_5_VLForConditionalGeneration names, flags) of a text encoder file;
    fp8 weights not yet dequantized (their scales renamed alongside)."""
    tensors = _read_tensors(path, "text encoder")
    check_quant_formats(tensors, path)
    names, flags = text_encoder_names(tensors, path)
    return {new: tensors[old] for old, new in names.items()}, flags


def text_encoder_names(keys, path) -> tuple[dict[str, str], dict]:
    """({file key: transformers 5 name} of the tensors a model takes, flags) of a text encoder file's keys:
    the ComfyUI prefix stripped (keys outside it ignored), the `scaled_fp8` marker turned into a flag, input
    scales and quantization notes dropped. Keys outside Qwen2.5-VL's layout raise SingleFileError."""
    keys = list(keys)
    prefix = next((p for p in TE_PREFIXES if any(k.startswith(p) for k in keys)), "")
    flags, weights = {"scaled_fp8": False}, []
    for file_key in keys:
        if not file_key.startswith(prefix):
            continue
        key = file_key[len(prefix):]
        if key == "scaled_fp8":
            flags["scaled_fp8"] = True
        elif not key.endswith(_DROP_SUFFIXES):
            weights.append(file_key)

    def diffusers_name(file_key: str) -> str | None:
        key = file_key[len(prefix):]
        return next((to + key[len(src):] for src, to in TE_RENAMES if key.startswith(src)), None)
    names, unknown = rename(weights, diffusers_name)
    if unknown:
        unknown = sorted(k[len(prefix):] for k in unknown)
        raise SingleFileError(f"{path}: keys outside Qwen2.5-VL's layout ({', '.join(unknown[:4])}); "
                              "expected model.* (language model), visual.* (vision tower) and lm_head.weight, as "
                              "in ComfyUI's text_encoders/qwen_2.5_vl_7b*.safetensors")
    return names, flags


def _shape(tensors, key, source, dim=None):
    if key not in tensors:
        raise SingleFileError(f"{source}: missing {key!r}; expected a Qwen2.5-VL text encoder with its vision tower "
                              "(ComfyUI's text_encoders/qwen_2.5_vl_7b*.safetensors)")
    shape = tuple(tensors[key].shape)
    return shape if dim is None else shape[dim]


def detect_text_encoder_config(tensors: dict[str, torch.Tensor], token_ids: dict[str, int],
                               source: str = "file") -> dict:
    """Qwen2_5_VLConfig keyword arguments of a (renamed) text encoder state dict.

    Widths, depths, vocabulary and patch geometry come from the shapes; the fields shapes cannot tell (heads,
    norm eps, rotary sections, attention windows) from the matching entry of `data/text_encoder_architectures.json`;
    the special-token ids from the tokenizer (`token_ids`, see TE_TOKENS), which must agree with the model."""
    lm, vis = "model.language_model.", "model.visual."
    if not any(k.startswith(lm + "layers.") for k in tensors):
        sample = ", ".join(sorted(tensors)[:4])
        raise SingleFileError(f"{source}: not a Qwen2.5-VL text encoder (no model.layers.*; found keys like "
                              f"{sample}); expected ComfyUI's text_encoders/qwen_2.5_vl_7b*.safetensors")
    vocab, hidden = _shape(tensors, lm + "embed_tokens.weight", source)
    shapes = {"hidden_size": hidden,
              "q_width": _shape(tensors, lm + "layers.0.self_attn.q_proj.weight", source, 0),
              "kv_width": _shape(tensors, lm + "layers.0.self_attn.k_proj.weight", source, 0),
              "vision_hidden_size": _shape(tensors, vis + "blocks.0.norm1.weight", source, 0),
              "out_hidden_size": _shape(tensors, vis + "merger.mlp.2.weight", source, 0)}
    known = json.loads(TE_ARCHITECTURES.read_text())
    for name, entry in known.items():
        text, vision = entry["text_config"], entry["vision_config"]
        head_dim = text["hidden_size"] // text["num_attention_heads"]
        expected = {"hidden_size": text["hidden_size"], "q_width": text["num_attention_heads"] * head_dim,
                    "kv_width": text["num_key_value_heads"] * head_dim, "vision_hidden_size": vision["hidden_size"],
                    "out_hidden_size": vision["out_hidden_size"]}
        if expected != shapes:
            continue
        layers = 1 + max(int(m.group(1)) for k in tensors
                         if (m := re.match(r"model\.language_model\.layers\.(\d+)\.", k)))
        depth = 1 + max(int(m.group(1)) for k in tensors if (m := re.match(r"model\.visual\.blocks\.(\d+)\.", k)))
        width, channels, temporal, patch, _ = _shape(tensors, vis + "patch_embed.proj.weight", source)
        merged = _shape(tensors, vis + "merger.mlp.0.weight", source, 1)
        text = {**text, "vocab_size": vocab, "num_hidden_layers": layers,
                "intermediate_size": _shape(tensors, lm + "layers.0.mlp.gate_proj.weight", source, 0)}
        vision = {**vision, "depth": depth, "in_channels": channels, "temporal_patch_size": temporal,
                  "patch_size": patch, "spatial_merge_size": round((merged // width) ** 0.5),
                  "intermediate_size": _shape(tensors, vis + "blocks.0.mlp.gate_proj.weight", source, 0)}
        bad = {k: v for k, v in token_ids.items() if not 0 <= v < vocab}
        if bad:
            raise SingleFileError(f"{source}: the tokenizer's token ids {bad} are outside the encoder's vocabulary of "
                                  f"{vocab}: the tokenizer does not belong to this text encoder")
        text.update(bos_token_id=token_ids["bos_token_id"], eos_token_id=token_ids["eos_token_id"])
        log.info("%s: %s text encoder, %d layers, vision depth %d%s", source, name, layers, depth,
                 "" if "lm_head.weight" in tensors else ", no lm_head (tied to the embeddings; logits are unused)")
        return {"text_config": text, "vision_config": vision,
                "tie_word_embeddings": "lm_head.weight" not in tensors,
                **{k: token_ids[k] for k in TE_TOKENS}}
    raise SingleFileError(f"{source}: unknown Qwen2.5-VL architecture {shapes}; known: {', '.join(known)} "
                          f"(shipped in {TE_ARCHITECTURES.name})")


def text_encoder_token_ids(tokenizer) -> dict[str, int]:
    """The special-token ids a Qwen2.5-VL config takes, from its tokenizer."""
    names = {**TE_TOKENS, "bos_token_id": "<|endoftext|>", "eos_token_id": "<|im_end|>"}
    vocab = tokenizer.get_vocab()  # added tokens included; convert_tokens_to_ids would answer unk for a missing one
    ids = {field: vocab.get(token) for field, token in names.items()}
    missing = [names[f] for f, i in ids.items() if i is None]
    if missing:
        raise SingleFileError(f"the tokenizer lacks Qwen2.5-VL's special tokens {missing}; expected Qwen2.5's "
                              "tokenizer (a diffusers model's processor/ or ComfyUI's qwen25_tokenizer)")
    return ids


def load_text_encoder_file(path, *, device: torch.device, dtype: torch.dtype, tokenizer):
    """Qwen2_5_VLForConditionalGeneration from one safetensors file, frozen, on `device` in `dtype`.

    `tokenizer` (the processor's) gives the special-token ids. bf16/fp32 files load exactly. Scaled fp8 files
    are upcast at load (w = fp8.float() * scale, then `dtype`), so they take the memory of `dtype`, not fp8's:
    the real encoder (Qwen2.5-VL-7B, 8.29 B parameters with lm_head, 7.75 B without) is 15.4 GiB in bf16
    (14.4 GiB without lm_head) after the upcast and 30.9 GiB in fp32, against about 7.7 GiB on disk for the
    scaled-fp8 file (7.2 B linear weights at 1 byte, the embeddings, norms and biases in bf16; 8.7 GiB if it
    carries lm_head in bf16). The file is streamed (`file_stream`): the architecture comes from its header,
    the model is built on the meta device, then one module at a time is read, moved to `device` and upcast
    there, so host memory holds one module beyond the model itself (nothing of it when `device` is a GPU).
    A file without `lm_head.weight` (ComfyUI does not build lm_head) gets lm_head tied to the input embeddings:
    the hidden states the pipelines use do not depend on it.
    """
    from accelerate import init_empty_weights
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    with torch.inference_mode(False):
        header = checked_header(path, "text encoder")  # meta tensors: shapes and dtypes only
        names, flags = text_encoder_names(header, path)
        header = {new: header[old] for old, new in names.items()}
        config = Qwen2_5_VLConfig(**detect_text_encoder_config(header, text_encoder_token_ids(tokenizer),
                                                               source=str(path)))
        with init_empty_weights():  # parameters on the meta device; the rotary buffers are computed
            model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype)
        expected = model.state_dict()
        if config.tie_word_embeddings:
            expected.pop("lm_head.weight", None)
        check_state_dict(dequantize(header, dtype), expected,
                         f"{path}: does not match the detected Qwen2.5-VL architecture")
        file_stream.stream_into(model, Path(path), names, lambda t: dequantize(t, dtype), torch.device(device))
        if config.tie_word_embeddings:
            model.tie_weights()
        left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
        if left:
            raise SingleFileError(f"{path}: no weights for {left[:4]} after loading")
        if flags["scaled_fp8"]:
            log.info("%s: scaled fp8 upcast to %s", path, dtype)
        return model.to(device).eval().requires_grad_(False)


# -- tokenizer and processor from ComfyUI's bundled files ---------------------------------------------------------
# ComfyUI ships Qwen2.5's tokenizer inside its source tree, comfy/text_encoders/qwen25_tokenizer/ (vocab.json,
# merges.txt, tokenizer_config.json), and reads it with transformers' Qwen2Tokenizer
# (comfy/text_encoders/qwen_image.py Qwen25_7BVLITokenizer). It has no image processor files: its own
# preprocessing (comfy/text_encoders/qwen_vl.py process_qwen2vl_images) uses min_pixels 3136, max_pixels 12845056,
# patch 14, merge 2, temporal patch 2 and CLIP's mean/std, the settings of Qwen2.5-VL-7B's
# preprocessor_config.json that a diffusers Qwen-Image model keeps in processor/. The files are read where the
# running ComfyUI keeps them (nodes/comfy_runtime.py comfyui_dir) or under an explicit `comfyui_dir`;
# nothing of them is copied into this project.
COMFY_TOKENIZER_DIR = Path("comfy") / "text_encoders" / "qwen25_tokenizer"
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")
QWEN_IMAGE_PROCESSOR = {"min_pixels": 56 * 56, "max_pixels": 14 * 14 * 4 * 16384, "patch_size": 14, "merge_size": 2,
                        "temporal_patch_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                        "image_std": [0.26862954, 0.26130258, 0.27577711]}


def comfy_tokenizer_dir(comfyui_dir) -> Path:
    """The folder of ComfyUI's bundled Qwen2.5 tokenizer: `comfyui_dir` is a ComfyUI installation (its
    comfy/text_encoders/qwen25_tokenizer is used) or that folder itself. Errors say which files are missing."""
    root = Path(comfyui_dir).expanduser()
    folder = root if (root / "vocab.json").is_file() else root / COMFY_TOKENIZER_DIR
    missing = [name for name in TOKENIZER_FILES if not (folder / name).is_file()]
    if missing:
        raise SingleFileError(f"ComfyUI folder {str(root)!r}: {str(folder)!r} lacks {', '.join(missing)}; expected "
                              f"a ComfyUI installation with {COMFY_TOKENIZER_DIR.as_posix()}/ "
                              f"({', '.join(TOKENIZER_FILES)}) or that folder itself")
    return folder


def processor_from_tokenizer_files(folder, image_processor: dict | None = None):
    """A Qwen2VLProcessor from Qwen2.5 tokenizer files (ComfyUI's qwen25_tokenizer layout) with Qwen-Image's
    image processor settings (`image_processor` overrides them)."""
    from transformers import Qwen2Tokenizer, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    folder = Path(folder)
    tokenizer = Qwen2Tokenizer.from_pretrained(str(folder))
    settings = {**QWEN_IMAGE_PROCESSOR, **(image_processor or {})}
    video = {k: v for k, v in settings.items() if k not in ("image_mean", "image_std")}
    log.info("tokenizer from %s (%d tokens), Qwen-Image image processor settings", folder, len(tokenizer))
    return Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**settings), tokenizer=tokenizer,
                            video_processor=Qwen2VLVideoProcessor(**video))
