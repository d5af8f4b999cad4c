"""Model families: the architecture a variant belongs to, as one frozen description every stage asks.

Two families exist. The 2025 Qwen-Image family (Edit, Edit Plus 2509, Edit 2511): a dual-stream 20 B MMDiT
(`QwenImageTransformer2DModel`), a Qwen2.5-VL text encoder, a 16-channel 8x VAE, latents packed in 2x2
patches, control images appended after the target's tokens. Qwen-Image-2.1: a single-stream, block-causal 7 B
DiT (`QwenImage21Transformer2DModel`) whose reference images sit inside the text sequence, before the target,
with a prefix key/value cache; a Qwen3-VL text encoder; a 64-channel 16x VAE that also decodes alpha (RGBA);
latents unpatched (one token per latent pixel). docs/MODEL.md gives the sources.

Stages read these fields, never a family or variant name: loaders take the class names, the encoders the
latent geometry, the sampler `references`, `cfg_rescale` and `prefix_cache`, LoRA injection `lora_targets`,
the speed levers the block list `blocks`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

#: where the control / reference latents go in the transformer's image sequence
REFERENCE_LAYOUTS = ("after-target", "in-text")


@dataclass(frozen=True)
class Family:
    """One model architecture as the stages see it."""

    #: short name, for messages and docs
    name: str
    title: str
    #: diffusers class of the transformer (diffusers.<name>) and of the VAE
    transformer_class: str
    vae_class: str
    #: transformers classes of the text encoder and of the processor (tokenizer + image processor) feeding it
    text_encoder_class: str
    processor_class: str
    #: channels of one latent pixel (the VAE's z_dim)
    latent_channels: int
    #: pixels per latent pixel along each side (the VAE's spatial downscale)
    vae_scale: int
    #: latent pixels per transformer token along each side (2: 2x2 patches, 1: unpatched)
    patch: int
    #: "after-target": [target | controls] image tokens beside the text stream (2025); "in-text": each
    #: reference's tokens replace its vision slots in the text, the target's come last (2.1)
    references: str
    #: the most reference images the model takes (None: no limit of the architecture)
    max_references: int | None
    #: true CFG rescales the combined prediction per token to the conditional one's norm (2025 pipelines)
    cfg_rescale: bool
    #: the text and reference tokens' keys/values do not change between steps and can be cached (2.1)
    prefix_cache: bool
    #: the VAE decodes a fourth (alpha) channel
    alpha: bool
    #: the transformer's attribute holding its list of blocks (what checkpointing, fp8, compile, offload walk)
    blocks: str
    #: LoRA target presets: preset name -> module-name suffixes inside the blocks
    lora_targets: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: the weights' licence, for the docs and the load log line
    licence: str = ""
    #: the module (dotted path) that reads this family's transformer as one ComfyUI file: its
    #: `detect_config(tensors, flags, source)` gives the diffusers config from the file's shapes and its
    #: `to_model(tensors)` maps a module's file tensors (weights, scales) onto the diffusers class's keys
    file_layout: str = "qwen_edit_core.model.single_file"
    #: a key only this family's transformer files have ("" : the family of any file without another's marker)
    file_marker: str = ""

    @property
    def token_pixels(self) -> int:
        """Pixels per transformer token along each side (16 in both families); image sides are multiples of it."""
        return self.vae_scale * self.patch

    def layout(self):
        """The module reading this family's transformer files (`file_layout`)."""
        import importlib
        return importlib.import_module(self.file_layout)

    def class_of(self, component: str):
        """The library class of a component ("transformer", "vae", "text_encoder", "processor")."""
        import diffusers
        import transformers
        library = diffusers if component in ("transformer", "vae") else transformers
        return getattr(library, getattr(self, f"{component}_class"))


_ATTN_2025 = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
_ATTN_21 = ("to_q", "to_k", "to_v", "to_out.0")

QWEN_IMAGE = Family(
    name="qwen-image", title="Qwen-Image (2025: Edit, Edit-2509, Edit-2511)",
    transformer_class="QwenImageTransformer2DModel", vae_class="AutoencoderKLQwenImage",
    text_encoder_class="Qwen2_5_VLForConditionalGeneration", processor_class="Qwen2VLProcessor",
    latent_channels=16, vae_scale=8, patch=2, references="after-target", max_references=None, cfg_rescale=True,
    prefix_cache=False, alpha=False, blocks="transformer_blocks",
    lora_targets=MappingProxyType({
        "attn": _ATTN_2025,
        "attn-img": ("to_q", "to_k", "to_v", "to_out.0"),
        "all": _ATTN_2025 + ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"),
    }),
    licence="Apache-2.0")

QWEN_IMAGE_21 = Family(
    name="qwen-image-2.1", title="Qwen-Image-2.1",
    transformer_class="QwenImage21Transformer2DModel", vae_class="AutoencoderKLQwenImage21",
    text_encoder_class="Qwen3VLForConditionalGeneration", processor_class="Qwen3VLProcessor",
    latent_channels=64, vae_scale=16, patch=1, references="in-text", max_references=10, cfg_rescale=False,
    prefix_cache=True, alpha=True, blocks="transformer_blocks",
    # Single stream: the text and image tokens share every projection, so "attn" and "attn-img" are the same.
    lora_targets=MappingProxyType({
        "attn": _ATTN_21,
        "attn-img": _ATTN_21,
        "all": _ATTN_21 + ("img_mlp.proj", "img_mlp.gate_layer", "img_mlp.out"),
    }),
    licence="Qwen Research License (non-commercial research and evaluation only)",
    file_layout="qwen_edit_core.families.qwen_image_21.single_file", file_marker="txt_in.text_norm.weight")

FAMILIES: dict[str, Family] = {f.name: f for f in (QWEN_IMAGE, QWEN_IMAGE_21)}


def family_of_model(model) -> Family:
    """The family whose transformer class `model` is (or derives from); the 2025 family for anything else."""
    names = {c.__name__ for c in type(model).__mro__}
    return next((f for f in FAMILIES.values() if f.transformer_class in names), QWEN_IMAGE)


def family_of_file(keys) -> Family:
    """The family of a transformer file from its keys (prefixed or not): the one whose `file_marker` it holds,
    else the 2025 family."""
    def holds(marker: str) -> bool:
        return any(k == marker or k.endswith("." + marker) for k in keys)
    return next((f for f in FAMILIES.values() if f.file_marker and holds(f.file_marker)), QWEN_IMAGE)


def family_of_class(class_name: str) -> Family:
    """The family whose transformer class is `class_name` (a diffusers config's `_class_name`); the 2025 family
    for any other."""
    return next((f for f in FAMILIES.values() if f.transformer_class == class_name), QWEN_IMAGE)
