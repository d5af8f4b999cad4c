"""Model families: the architecture a variant belongs to, as one frozen description every stage asks.

Two families exist. The 2025 Qwen-Image family (Edit, Edit Plus 2509, Edit 2511): a dual-stream 20 B MMDiT
(`QwenImageTransformer2DModel`), a Qwen2.5-VL text encoder, a 16-channel 8x VAE, latents packed in 2x2
patches, control images appended after the target's tokens. Qwen-Image-2.1: a single-stream, block-causal 7 B
DiT (`QwenImage21Transformer2DModel`) whose reference images sit inside the text sequence, before the target,
with a prefix key/value cache; a Qwen3-VL text encoder; a 64-channel 16x VAE that also decodes alpha (RGBA);
latents unpatched (one token per latent pixel). docs/MODEL.md gives the sources.

Stages read these fields, never a family or variant name: loaders take the class names, the encoders the
latent geometry, the sampler `references`, `cfg_rescale` and `prefix_cache`, LoRA injection `lora_targets`,
the speed levers the block list `blocks`. Behaviour a stage cannot express with these fields is the family's
own: `Family.stage(name)` is the module `name` of the family's subpackage (`package`), whose functions the
stage calls (docs/DESIGN.md, "Adding a model family", lists them). `family_of` answers "which family" for a
model, a file's keys, a model directory, a cache entry or key, and a training batch.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Mapping

#: where the control / reference latents go in the transformer's image sequence
REFERENCE_LAYOUTS = ("after-target", "in-text")


class MissingStage(LookupError):
    """A family has no module for a stage (`Family.stage`): the message names the module to add."""


@dataclass(frozen=True)
class Toy:
    """A family's built-in models (toys/): the random tiny one (`model.tiny.build_tiny`) and the pretrained toy,
    whose weights ship in toys/weights/<family name>/ (`toys.toy.weights_dir`)."""

    #: the variant both are built as (`qwen-edit tiny --pretrained --variant`, the demo's `--variant`)
    variant: str
    #: their name in the loader nodes' model choices and built-in folders ("<label>-tiny", "<label>-toy")
    label: str
    #: the VAE's decoder trains on its own after the transformer (`qwen-edit tiny --pretrained --train-vae`); False:
    #: the VAE is fitted within the whole build
    vae_trains_alone: bool
    #: the demo's folder for the toy model directory it builds
    demo_folder: str
    #: a few-step schedule (`sample.sigmas` preset) the demo also scores its LoRA at ("": none)
    few_step_sigmas: str = ""


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
    #: the class name of one transformer block (the FSDP unit: train/sharding.py)
    block_class: str
    #: the transformer's attribute holding its list of blocks (what checkpointing, fp8, compile, offload walk)
    blocks: str
    #: LoRA target presets: preset name -> module-name suffixes inside the blocks
    lora_targets: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: module-name suffixes inside the last block whose output reaches no loss (the transformer discards that
    #: block's text stream): no LoRA is trained there (`adapters.lora.unreached_modules`), so every trained
    #: parameter gets a gradient (DDP without `find_unused_parameters`; compiled and eager blocks agree)
    unreached_in_last_block: tuple[str, ...] = ()
    #: the weights' licence, for the docs and the load log line
    licence: str = ""
    #: the module (dotted path) that reads this family's transformer as one ComfyUI file: its
    #: `detect_config(tensors, flags, source)` gives the diffusers config from the file's shapes and its
    #: `to_model(tensors)` maps a module's file tensors (weights, scales) onto the diffusers class's keys
    file_layout: str = "qwen_edit_core.families.qwen_image.single_file"
    #: a key only this family's transformer files have ("" : the family of any file without another's marker)
    file_marker: str = ""
    #: what its files are called in messages ("a <file_title> transformer")
    file_title: str = ""
    #: the subpackage (dotted path) holding this family's behaviour, one module per stage (`stage`)
    package: str = "qwen_edit_core.families.qwen_image"
    #: a cache key's `family` field for this family's entries ("": the first family's, keyed before the field)
    cache_name: str = ""
    #: tensors this family's cache entries hold besides the shared ones (data/cache_tensors.py)
    cache_tensors: tuple[str, ...] = ()
    #: the text encoder's vision tokens of each control image lengthen the text stream the transformer reads
    #: (False: a reference's latent tokens take its slots and count as image tokens)
    vision_in_text: bool = True
    #: samples of different sizes train in one call, padded, through adapters/multires.py's joint attention
    #: processor (False: the family's batch runs one call per token layout)
    padded_batches: bool = True
    #: the prefix of the keys of a ComfyUI LoRA file for this family's transformer (what ComfyUI's loader expects)
    lora_prefix: str = "diffusion_model."
    #: the true CFG scale the family's pipelines sample at by default (docs/MODEL.md: the 2025 edit pipelines'
    #: true_cfg_scale 4.0; Qwen-Image-2.1 is CFG-distilled, 1: off); what a node's CFG "auto" means
    pipeline_cfg: float = 4.0
    #: its built-in tiny and toy models (None: it has none)
    toy: Toy | None = None

    @property
    def token_pixels(self) -> int:
        """Pixels per transformer token along each side (16 in both families); image sides are multiples of it."""
        return self.vae_scale * self.patch

    @property
    def ordered_references(self) -> bool:
        """Whether the model takes reference images in the user's order inside its text (any sizes, RGBA where the
        VAE reads alpha), rather than control images after the target's tokens: what the nodes and the demo pass."""
        return self.references == "in-text"

    def layout(self):
        """The module reading this family's transformer files (`file_layout`)."""
        return importlib.import_module(self.file_layout)

    def stage(self, name: str) -> ModuleType:
        """This family's module for stage `name` ("example_tensors", "batch", "sampler", ...): the functions that
        stage calls for this family (docs/DESIGN.md, "Adding a model family")."""
        try:
            return importlib.import_module(f"{self.package}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{self.package}.{name}":
                raise
            raise MissingStage(f"model family {self.name!r} has no {name!r} stage module: add {self.package}."
                               f"{name} with the functions docs/DESIGN.md lists") from None

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
    prefix_cache=False, alpha=False, block_class="QwenImageTransformerBlock", blocks="transformer_blocks",
    lora_targets=MappingProxyType({
        "attn": _ATTN_2025,
        "attn-img": ("to_q", "to_k", "to_v", "to_out.0"),
        "all": _ATTN_2025 + ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"),
    }),
    # the last block's text stream after attention: diffusers' QwenImageTransformer2DModel.forward keeps only
    # the image stream (`hidden_states`) of its last block; tests/adapters/test_lora.py derives this by autograd
    unreached_in_last_block=("attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2"),
    licence="Apache-2.0", file_title="Qwen-Image-Edit (2025)",
    toy=Toy(variant="edit", label="qwen-edit", vae_trains_alone=True, demo_folder="toy-model"))

QWEN_IMAGE_21 = Family(
    name="qwen-image-2.1", title="Qwen-Image-2.1",
    transformer_class="QwenImage21Transformer2DModel", vae_class="AutoencoderKLQwenImage21",
    text_encoder_class="Qwen3VLForConditionalGeneration", processor_class="Qwen3VLProcessor",
    latent_channels=64, vae_scale=16, patch=1, references="in-text", max_references=10, cfg_rescale=False,
    prefix_cache=True, alpha=True, block_class="QwenImage21TransformerBlock", blocks="transformer_blocks",
    # Single stream: the text and image tokens share every projection, so "attn" and "attn-img" are the same.
    lora_targets=MappingProxyType({
        "attn": _ATTN_21,
        "attn-img": _ATTN_21,
        "all": _ATTN_21 + ("img_mlp.proj", "img_mlp.gate_layer", "img_mlp.out"),
    }),
    licence="Qwen Research License (non-commercial research and evaluation only)",
    file_layout="qwen_edit_core.families.qwen_image_21.single_file", file_marker="txt_in.text_norm.weight",
    package="qwen_edit_core.families.qwen_image_21", file_title="Qwen-Image-2.1", cache_name="qwen-image-2.1",
    cache_tensors=("prompt_slots", "empty_prompt_slots"), vision_in_text=False, padded_batches=False,
    lora_prefix="", pipeline_cfg=1.0,
    toy=Toy(variant="image-2.1", label="qwen-image-2.1", vae_trains_alone=False, demo_folder="toy21-model",
            few_step_sigmas="qwen21-turbo-8step"))

FAMILIES: dict[str, Family] = {f.name: f for f in (QWEN_IMAGE, QWEN_IMAGE_21)}
#: the family of whatever carries no other family's mark (files, directories and cache entries made before the
#: second family existed)
DEFAULT = QWEN_IMAGE


def register(family: Family) -> Family:
    """Add `family` to FAMILIES (what `family_of` searches); ValueError when its name, cache name or markers are
    already another family's."""
    for other in FAMILIES.values():
        clash = [what for what in ("name", "cache_name", "transformer_class")
                 if getattr(other, what) == getattr(family, what)]
        if other is not family and clash:
            raise ValueError(f"model family {family.name!r}: its {', '.join(clash)} already belong to "
                             f"{other.name!r}; give it its own")
    FAMILIES[family.name] = family
    return family


def unregister(family: Family) -> None:
    """Remove a family `register` added (the two shipped ones stay)."""
    if family in (QWEN_IMAGE, QWEN_IMAGE_21):
        raise ValueError(f"model family {family.name!r} ships with the package and cannot be removed")
    FAMILIES.pop(family.name, None)


def family_of(thing) -> Family:
    """Which family `thing` belongs to, the one question every stage asks: a transformer (its class), a model
    directory (its transformer's config.json class), a diffusers config (its `_class_name`), a training batch (its
    `family`), a cache key (its `family` field), a cache entry's tensors (a family's `cache_tensors`), a file's
    header or keys (a transformer file's `file_marker`, else a VAE file a family's `vae_file` stage claims), or a
    file's metadata strings (a LoRA's `architecture`: the family name; a validation file's `family`: the cache
    name; KeyError for a name no family has). Anything without another family's mark is the DEFAULT family's."""
    import torch
    if isinstance(thing, torch.nn.Module):
        return family_of_model(thing)
    if isinstance(thing, (str, Path)) and Path(thing).is_dir():
        config = Path(thing) / "transformer" / "config.json"
        return family_of_class(json.loads(config.read_text()).get("_class_name", "") if config.is_file() else "")
    if isinstance(getattr(thing, "family", None), Family):
        return thing.family
    if isinstance(getattr(thing, "family", None), str):  # a cache key
        return family_of_cache_name(thing.family)
    if isinstance(thing, Mapping) and thing:
        if "_class_name" in thing:  # a diffusers config
            return family_of_class(thing["_class_name"])
        if all(isinstance(v, str) for v in thing.values()):  # a safetensors file's metadata
            return _family_of_metadata(thing)
        if all(isinstance(v, torch.Tensor) for v in thing.values()):
            marked = [f for f in FAMILIES.values() if f.cache_tensors and set(f.cache_tensors) <= set(thing)]
            if marked:
                return marked[0]
            if family_of_file(thing) is DEFAULT:  # no transformer file's marker: perhaps a VAE file's header
                return family_of_vae(thing)
    return family_of_file(thing)


def _family_of_metadata(metadata: Mapping[str, str]) -> Family:
    """The family a safetensors file's metadata names: `architecture` (a LoRA file: the family's name) or `family`
    (a validation latents file: its cache name); KeyError for a name no family has; DEFAULT when neither is set."""
    if "architecture" in metadata:
        found = FAMILIES.get(metadata["architecture"])
        if found is None:
            raise KeyError(f"model family {metadata['architecture']!r}: not a family this code knows "
                           f"(known: {', '.join(map(repr, FAMILIES))})")
        return found
    return family_of_cache_name(metadata.get("family", DEFAULT.cache_name))


def family_of_vae(header) -> Family:
    """The family of a VAE file from its header: the first family other than DEFAULT whose `claims` (its
    vae_file stage module) accepts it, else DEFAULT."""
    return next((f for f in FAMILIES.values() if f is not DEFAULT and f.stage("vae_file").claims(header)), DEFAULT)


def family_of_cache_name(name: str) -> Family:
    """The family whose cache entries carry `name` in their key's `family` field; KeyError naming the known ones."""
    found = next((f for f in FAMILIES.values() if f.cache_name == name), None)
    if found is None:
        known = ", ".join(repr(f.cache_name) for f in FAMILIES.values())
        raise KeyError(f"cache entries of model family {name!r}: not a family this code trains (known: {known})")
    return found


def family_of_model(model) -> Family:
    """The family whose transformer class `model` is, or derives from most closely (a family's class may derive
    from another's); DEFAULT for anything else."""
    by_class = {f.transformer_class: f for f in FAMILIES.values()}
    return next((by_class[c.__name__] for c in type(model).__mro__ if c.__name__ in by_class), DEFAULT)


def family_of_file(keys) -> Family:
    """The family of a transformer file from its keys (prefixed or not): the one whose `file_marker` it holds,
    else the 2025 family."""
    def holds(marker: str) -> bool:
        return any(k == marker or k.endswith("." + marker) for k in keys)
    return next((f for f in FAMILIES.values() if f.file_marker and holds(f.file_marker)), DEFAULT)


def family_of_class(class_name: str) -> Family:
    """The family whose transformer class is `class_name` (a diffusers config's `_class_name`); the 2025 family
    for any other."""
    return next((f for f in FAMILIES.values() if f.transformer_class == class_name), DEFAULT)
