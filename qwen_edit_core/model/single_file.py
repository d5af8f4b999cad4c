"""The model files ComfyUI users already have: a Qwen-Image transformer as one safetensors file.

Layout, learned from ComfyUI's and diffusers' own source:
- Key names are diffusers' module paths: ComfyUI's `comfy/ldm/qwen_image/model.py` names its modules like
  diffusers' `QwenImageTransformer2DModel`, and diffusers' `loaders/single_file_model.py` maps a Qwen-Image
  single file with the identity. Files saved from a ComfyUI model carry the `model.diffusion_model.` prefix
  (stripped by `comfy/sd.py` load_diffusion_model); both are accepted.
- `__index_timestep_zero__` (an empty tensor, registered as a buffer in comfy/ldm/qwen_image/model.py when
  `default_ref_method == "index_timestep_zero"`) marks Edit-2511: `zero_cond_t=True` in diffusers.
- Scaled fp8 (comfy/model_detection.py: a `scaled_fp8` key; comfy/ops.py: per-layer `.scale_weight`, weight
  = fp8 * scale_weight, optional `.scale_input`) and the newer per-layer `.weight_scale` + `.comfy_quant` form.
  fp8 weights are either upcast at load to the requested dtype (w = fp8.float() * scale), or kept: the block
  linears become `speed.Fp8Linear` holding the file's e4m3 bytes unchanged with the per-tensor scale as their
  per-channel scales (the same effective weights), and run fp8 matmuls. `fp8="auto"` keeps them where the
  device computes in fp8 (CUDA, compute capability >= 8.9) and upcasts elsewhere; the log says which, with
  the weights' memory (the real transformer: 19.1 GiB kept against 38.1 GiB in bf16, counted on a meta-device
  model).
The architecture is read from the shapes and matched against the configs shipped in
`data/transformer_architectures.json`.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

log = logging.getLogger(__name__)

PREFIXES = ("model.diffusion_model.", "diffusion_model.")
ZERO_COND_MARKER = "__index_timestep_zero__"
_SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
_DROP_SUFFIXES = (".scale_input", ".input_scale", ".comfy_quant")
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
ARCHITECTURES = Path(__file__).parent / "architectures" / "transformer_architectures.json"


class SingleFileError(ValueError):
    """A model file this loader cannot use; the message names the file and what was expected."""


def _read_tensors(path, what: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file; errors name the file and say what it should be."""
    path = Path(path)
    if not path.is_file():
        raise SingleFileError(f"{what} file {str(path)!r} does not exist")
    try:
        with safe_open(str(path), framework="pt") as fh:
            return {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as err:  # noqa: BLE001 - safetensors raises several types for damaged files
        raise SingleFileError(f"{str(path)!r} is not a readable safetensors file: {err}") from None


def check_quant_formats(tensors: dict[str, torch.Tensor], source) -> None:
    """Refuse layers quantized in a format other than scaled fp8 (the `.comfy_quant` JSON names it, e.g. nvfp4,
    whose packed weights and block scales this loader cannot upcast)."""
    formats = {}
    for key, value in tensors.items():
        if key.endswith(".comfy_quant"):
            try:
                formats[key] = json.loads(bytes(value.to(torch.uint8).tolist())).get("format", "")
            except (ValueError, AttributeError):
                formats[key] = "unreadable"
    other = {k: f for k, f in formats.items() if not str(f).startswith("float8")}
    if other:
        key, fmt = next(iter(other.items()))
        raise SingleFileError(f"{source}: {len(other)} layer(s) quantized as {fmt!r} ({key}); only bf16/fp16/fp32 and "
                              "scaled fp8 (float8_e4m3fn / float8_e5m2 with per-tensor scales) are read")


def read_state_dict(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors with diffusers names, flags) of a transformer file; fp8 weights not yet dequantized."""
    tensors = _read_tensors(path, "transformer")
    check_quant_formats(tensors, path)
    out, flags = {}, {"zero_cond_t": False, "scaled_fp8": False}
    for key, value in tensors.items():
        for prefix in PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix):]
                break
        if key == ZERO_COND_MARKER:
            flags["zero_cond_t"] = True
        elif key == "scaled_fp8":
            flags["scaled_fp8"] = True
        elif not key.endswith(_DROP_SUFFIXES):
            out[key] = value
    return out, flags


def dequantize(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Upcast fp8 weights with their per-layer scales; cast everything else to `dtype`."""
    scales = {k[: -len(s)]: v for k, v in tensors.items() for s in _SCALE_SUFFIXES if k.endswith(s)}
    out = {}
    for key, value in tensors.items():
        if key.endswith(_SCALE_SUFFIXES):
            continue
        if value.dtype in _FP8:
            scale = scales.get(key.removesuffix(".weight"))
            value = value.float() * (scale.float() if scale is not None else 1.0)
        out[key] = value.to(dtype)
    return out


def detect_config(tensors: dict[str, torch.Tensor], flags: dict, source: str = "file") -> dict:
    """The diffusers config of a Qwen-Image transformer state dict, from its shapes."""
    needed = ("img_in.weight", "txt_in.weight", "proj_out.weight", "transformer_blocks.0.attn.norm_q.weight")
    missing = [k for k in needed if k not in tensors]
    if missing:
        sample = ", ".join(sorted(tensors)[:4])
        raise SingleFileError(f"{source}: not a Qwen-Image transformer (missing {missing}; found keys like {sample}); "
                              "expected a Qwen-Image/-Edit diffusion model from ComfyUI's diffusion_models folder")
    width, in_channels = tensors["img_in.weight"].shape
    head_dim = tensors["transformer_blocks.0.attn.norm_q.weight"].shape[0]
    layers = 1 + max(int(m.group(1)) for k in tensors if (m := re.match(r"transformer_blocks\.(\d+)\.", k)))
    shapes = {"in_channels": in_channels, "attention_head_dim": head_dim, "num_attention_heads": width // head_dim,
              "joint_attention_dim": tensors["txt_in.weight"].shape[1],
              "out_channels": tensors["proj_out.weight"].shape[0] // 4}
    known = json.loads(ARCHITECTURES.read_text())
    for name, config in known.items():
        if all(config[k] == v for k, v in shapes.items()):
            config = {k: v for k, v in config.items() if not k.startswith("_")}
            config.update(num_layers=layers, zero_cond_t=flags["zero_cond_t"],
                          use_additional_t_cond="time_text_embed.addition_t_embedding.weight" in tensors)
            config["axes_dims_rope"] = tuple(config["axes_dims_rope"])
            log.info("%s: %s architecture, %d blocks%s", source, name, layers,
                     ", zero_cond_t (Edit-2511)" if flags["zero_cond_t"] else "")
            return config
    raise SingleFileError(f"{source}: unknown Qwen-Image architecture {shapes}; known: {', '.join(known)} "
                          f"(shipped in {ARCHITECTURES.name})")


def check_state_dict(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], problem: str) -> None:
    """Raise SingleFileError(`problem`: the first missing and unexpected keys and wrong shapes) unless
    `tensors` has exactly the keys and shapes of `expected`."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [f"{k}: {tuple(tensors[k].shape)} (expected {tuple(v.shape)})" for k, v in expected.items()
             if k in tensors and tensors[k].shape != v.shape]
    if missing or unexpected or wrong:
        raise SingleFileError(f"{problem}: missing {missing[:4]}, unexpected {unexpected[:4]}, "
                              f"wrong shapes {wrong[:4]}")


FP8_MODES = ("auto", "keep", "upcast")


def keeps_fp8(mode: str, tensors: dict[str, torch.Tensor], device: torch.device) -> bool:
    """Whether a file's fp8 weights stay in fp8 (`mode` "auto": where the device computes in fp8)."""
    from qwen_edit_core import speed
    if mode not in FP8_MODES:
        raise ValueError(f"fp8 mode {mode!r} is not accepted; accepted: {', '.join(FP8_MODES)}")
    if mode == "upcast" or not any(v.dtype == torch.float8_e4m3fn for v in tensors.values()):
        return False
    device = torch.device(device)
    if mode == "auto":
        return device.type == "cuda" and speed.fp8_matmul_supported(device)
    if not speed.fp8_matmul_supported(device):
        raise ValueError(f"model.transformer_fp8 'keep' needs fp8 matmuls (CUDA compute capability >= 8.9); "
                         f"{device} has none: use 'upcast' or 'auto'")
    return True


def _fp8_state(tensors: dict[str, torch.Tensor], fp8_modules: set[str], dtype: torch.dtype) -> dict:
    """The state dict of a model whose `fp8_modules` are `speed.Fp8Linear`: their e4m3 weights as stored (the
    per-tensor scale broadcast to per-channel scales: the same effective weights), other weights in those
    modules quantized per channel, everything else upcast as `dequantize` does."""
    from qwen_edit_core import speed
    scales = {k[: -len(s)]: v for k, v in tensors.items() for s in _SCALE_SUFFIXES if k.endswith(s)}
    rest = {}
    out = {}
    for key, value in tensors.items():
        module, _, leaf = key.rpartition(".")
        if module not in fp8_modules or leaf != "weight":
            rest[key] = value
            continue
        scale = scales.get(module)
        if value.dtype == torch.float8_e4m3fn and (scale is None or scale.numel() in (1, value.shape[0])):
            scale = torch.ones(()) if scale is None else scale.float()
            out[f"{module}.weight_fp8"] = value
            out[f"{module}.weight_scale"] = scale.reshape(-1, 1).expand(value.shape[0], 1).contiguous()
        else:
            weight = value.float() * (scale.float() if scale is not None and value.dtype in _FP8 else 1.0)
            out[f"{module}.weight_fp8"], out[f"{module}.weight_scale"] = speed.quantize_rows(weight)
    return {**dequantize(rest, dtype), **out}


def _bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def load_transformer_file(path, *, device: torch.device, dtype: torch.dtype, fp8: str = "auto"):
    """A frozen QwenImageTransformer2DModel from one safetensors file, on `device` in `dtype`; a scaled-fp8
    file's block linears stay in fp8 or are upcast by `fp8` ("auto", "keep", "upcast"; see the module doc)."""
    from accelerate import init_empty_weights
    from diffusers import QwenImageTransformer2DModel

    from qwen_edit_core import speed

    # ComfyUI calls loaders under inference mode: tensors read there could never be trained (LoRA) on.
    with torch.inference_mode(False):
        raw, flags = read_state_dict(path)
        config = detect_config(raw, flags, source=str(path))
        keep = keeps_fp8(fp8, raw, device)
        with init_empty_weights():
            model = QwenImageTransformer2DModel(**config).requires_grad_(False)
            if keep:
                speed.quantize_fp8(model)
        fp8_modules = {n for n, m in model.named_modules() if isinstance(m, speed.Fp8Linear)}
        tensors = _fp8_state(raw, fp8_modules, dtype) if keep else dequantize(raw, dtype)
        check_state_dict(tensors, model.state_dict(), f"{path}: does not match the detected architecture")
        model.load_state_dict({k: v.to(device) for k, v in tensors.items()}, assign=True)
        model.to(device)
        if any(v.dtype in _FP8 for v in raw.values()):
            upcast = sum(v.numel() for k, v in raw.items() if not k.endswith(_SCALE_SUFFIXES)) * dtype.itemsize
            log.info("%s: scaled fp8 %s: weights take %.2f GiB on %s (%.2f GiB upcast to %s)", path,
                     "kept in fp8 (fp8 matmuls)" if keep else f"upcast to {dtype}", _bytes(model) / 2**30, device,
                     upcast / 2**30, dtype)
        return model.eval().requires_grad_(False)


# -- VAE ----------------------------------------------------------------------------------------------------
# ComfyUI's qwen_image_vae.safetensors is its Wan 2.1 VAE layout (comfy/sd.py recognises
# `decoder.middle.0.residual.0.gamma` and builds comfy.ldm.wan.vae.WanVAE with dim 96, z_dim 16,
# dim_mult [1, 2, 4, 4], num_res_blocks 2). diffusers' loaders/single_file_utils.py
# `convert_wan_vae_to_diffusers` maps that layout onto AutoencoderKLQwenImage's module names (same architecture;
# the converter assumes num_res_blocks 2, which the real VAE and our tiny VAE have).
VAE_PREFIXES = ("first_stage_model.", "vae.")
WAN_VAE_MARKER = "decoder.middle.0.residual.0.gamma"


def read_vae_state_dict(path) -> dict[str, torch.Tensor]:
    """A VAE file's tensors with diffusers (AutoencoderKLQwenImage) names, whichever of the two layouts."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    tensors = _read_tensors(path, "VAE")
    for prefix in VAE_PREFIXES:
        if tensors and all(k.startswith(prefix) for k in tensors):
            tensors = {k[len(prefix):]: v for k, v in tensors.items()}
    if WAN_VAE_MARKER in tensors:
        return convert_wan_vae_to_diffusers(tensors)
    if "decoder.mid_block.resnets.0.norm1.gamma" in tensors:
        return tensors
    sample = ", ".join(sorted(tensors)[:4])
    raise SingleFileError(f"{path}: not a Qwen-Image VAE (found keys like {sample}); expected ComfyUI's "
                          f"qwen_image_vae.safetensors layout ({WAN_VAE_MARKER}) or diffusers' AutoencoderKLQwenImage")


def load_vae_file(path, *, device: torch.device, dtype: torch.dtype, config: dict | None = None):
    """AutoencoderKLQwenImage from one file. `config` defaults to the real Qwen-Image VAE's (diffusers' class
    defaults, latents_mean/std included) with base_dim and z_dim read from the weights."""
    from diffusers import AutoencoderKLQwenImage

    with torch.inference_mode(False):
        tensors = read_vae_state_dict(path)
        if config is None:
            config = {"base_dim": tensors["encoder.conv_in.weight"].shape[0],
                      "z_dim": tensors["post_quant_conv.weight"].shape[0]}
        config = {k: v for k, v in config.items() if not k.startswith("_")}
        model = AutoencoderKLQwenImage(**config)
        expected = model.state_dict()
        missing = sorted(set(expected) - set(tensors))
        wrong = [f"{k}: {tuple(tensors[k].shape)} (expected {tuple(v.shape)})" for k, v in expected.items()
                 if k in tensors and tensors[k].shape != v.shape]
        if missing or wrong:
            raise SingleFileError(f"{path}: does not match a Qwen-Image VAE {config}: missing {missing[:4]}, "
                                  f"wrong shapes {wrong[:4]}")
        model.load_state_dict({k: tensors[k] for k in expected})
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


# -- text encoder ---------------------------------------------------------------------------------------------
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
TE_ARCHITECTURES = Path(__file__).parent / "architectures" / "text_encoder_architectures.json"
#: the tokens whose ids the model config must share with the tokenizer
TE_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
             "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}


def read_text_encoder_state_dict(path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors with transformers 5 Qwen2_5_VLForConditionalGeneration names, flags) of a text encoder file;
    fp8 weights not yet dequantized (their scales renamed alongside)."""
    tensors = _read_tensors(path, "text encoder")
    check_quant_formats(tensors, path)
    for prefix in TE_PREFIXES:
        if any(k.startswith(prefix) for k in tensors):
            tensors = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            break
    out, flags, unknown = {}, {"scaled_fp8": False}, []
    for key, value in tensors.items():
        if key == "scaled_fp8":
            flags["scaled_fp8"] = True
            continue
        if key.endswith(_DROP_SUFFIXES):
            continue
        new = next((to + key[len(src):] for src, to in TE_RENAMES if key.startswith(src)), None)
        if new is None:
            unknown.append(key)
        else:
            out[new] = value
    if unknown:
        raise SingleFileError(f"{path}: keys outside Qwen2.5-VL's layout ({', '.join(sorted(unknown)[:4])}); "
                              "expected model.* (language model), visual.* (vision tower) and lm_head.weight, as "
                              "in ComfyUI's text_encoders/qwen_2.5_vl_7b*.safetensors")
    return out, flags


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
        layers = 1 + max(int(m.group(1)) for k in tensors if (m := re.match(r"model\.language_model\.layers\.(\d+)\.", k)))
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
    carries lm_head in bf16). Loading also holds the file's tensors once more while they are converted.
    A file without `lm_head.weight` (ComfyUI does not build lm_head) gets lm_head tied to the input embeddings:
    the hidden states the pipelines use do not depend on it.
    """
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    with torch.inference_mode(False):
        raw, flags = read_text_encoder_state_dict(path)
        config = Qwen2_5_VLConfig(**detect_text_encoder_config(raw, text_encoder_token_ids(tokenizer),
                                                               source=str(path)))
        tensors = dequantize(raw, dtype)
        del raw
        with torch.device("meta"):
            expected = Qwen2_5_VLForConditionalGeneration(config).state_dict()
        if config.tie_word_embeddings:
            expected.pop("lm_head.weight", None)
        check_state_dict(tensors, expected, f"{path}: does not match the detected Qwen2.5-VL architecture")
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(None, config=config, state_dict=tensors,
                                                                   dtype=dtype)
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
