"""The model variants in one place: a frozen description per release (Qwen-Image-Edit, 2509, 2511, Qwen-Image-2.1)
that every stage reads; each names its architecture (`family`, families/family.py).

A variant says how a model is prompted (template, prompt prefix tokens dropped after encoding), which image
areas the VAE and the vision-language encoder see, how many control images it takes, whether its transformer
uses `zero_cond_t` (timestep zero for the condition tokens), and how to recognise it on disk: the
pipeline class of a diffusers directory's `model_index.json` (plus `transformer/config.json`'s
`zero_cond_t`), or the `__index_timestep_zero__` marker of a ComfyUI single transformer file. Template
strings and prefix lengths are the pipelines' own (`families/templates.py`); docs/MODEL.md gives the sources.

Adding a variant is one `Variant(...)` entry in `VARIANTS` plus its tests (docs/DESIGN.md, "Model families
and variants"). Stages never compare variant names: they ask the description (`get(name).max_controls`, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from qwen_edit_core.families import templates
from qwen_edit_core.families.family import FAMILIES, QWEN_IMAGE, QWEN_IMAGE_21, Family

#: The key ComfyUI's Qwen-Image model registers (an empty buffer) when its reference method is
#: "index_timestep_zero": such a transformer file is an Edit-2511 model (`zero_cond_t=True` in diffusers).
ZERO_COND_MARKER = "__index_timestep_zero__"


class UnknownVariantError(ValueError):
    """A variant name, pipeline class or model directory that no registry entry describes."""


@dataclass(frozen=True)
class Variant:
    """One model release as the stages see it."""

    #: the config / CLI value (`model.variant`, `--variant`)
    name: str
    #: the release(s) it describes, for messages and docs
    title: str
    #: `_class_name` of the diffusers `model_index.json` (the pipeline that runs it)
    pipeline_class: str
    #: the prompt template; `{}` receives the (image-prefixed) prompt
    template: str
    #: announced once per control image before the prompt ("Picture {}: <img>"); "" when the template holds the
    #: single image's tokens itself
    image_prefix: str
    #: template tokens (system prompt and chat framing) dropped from the encoder's hidden states; None: the
    #: processor's token count of the system message (Qwen-Image-2.1, whose pipeline counts it so)
    drop: int | None
    #: the most control images a sample may have (Edit Plus: 3, the model card's range is 1 to 3; None: any)
    max_controls: int | None
    #: True: the VL encoder sees each control image at its own `vl_area`; False: it sees the VAE-sized image
    vl_own_area: bool
    #: the transformer runs the condition tokens at timestep zero (diffusers' `zero_cond_t` config)
    zero_cond_t: bool
    #: the prompt/image encoding this variant shares with others; cache keys store it, so variants that encode
    #: alike share cache entries
    encoding: str
    #: the architecture (families/family.py): classes, latent geometry, reference layout, LoRA targets, blocks
    family: Family = QWEN_IMAGE
    #: put between two images' prefixes (2.1: a space)
    image_separator: str = ""

    def format_prompt(self, prompt: str, num_images: int) -> tuple[str, int | None]:
        """(text for the processor, number of leading tokens to drop) for one prompt with its control images."""
        self.check_controls(num_images, min_controls=0 if self.image_prefix else 1)
        if self.image_prefix:
            images = self.image_separator.join(self.image_prefix.format(i + 1) for i in range(num_images))
            return self.template.format(images + prompt), self.drop
        return self.template.format(prompt), self.drop

    def check_controls(self, count: int, min_controls: int = 1) -> None:
        """Refuse a number of control images this variant cannot take; the message names a variant that can."""
        if self.max_controls is not None and count > self.max_controls or count < min_controls:
            exactly = "exactly " if min_controls == self.max_controls else ""
            raise ValueError(f"variant {self.name!r} takes {exactly}{self.controls_text()}, got {count}; "
                             + self.more_controls_hint())

    def more_controls_hint(self) -> str:
        """What to do about too many control images for this variant."""
        if self.max_controls is not None and self.max_controls > 1:
            return f"give at most {self.max_controls}"
        several = " or ".join(repr(v.name) for v in VARIANTS.values()
                              if (v.max_controls or 2) > 1 and v.family is self.family)
        return f"use variant {several} for several"

    def controls_text(self) -> str:
        """"one control image", "at most 3 control images" or "any number of control images"."""
        if self.max_controls is None:
            return "any number of control images"
        return "one control image" if self.max_controls == 1 else f"at most {self.max_controls} control images"

    def vl_area(self, vae_area: int, vl_area: int) -> int:
        """The pixel area the VL encoder sees control images at."""
        return vl_area if self.vl_own_area else vae_area

    def vl_area_key(self, vl_area: int) -> int:
        """`vl_area` as the cache key stores it: 0 where the VL does not see its own area (it cannot matter)."""
        return vl_area if self.vl_own_area else 0


_EDIT_PLUS_COMMON = dict(pipeline_class="QwenImageEditPlusPipeline", template=templates.EDIT_PLUS_TEMPLATE,
                         image_prefix=templates.EDIT_PLUS_IMAGE_PREFIX, drop=templates.EDIT_PLUS_DROP,
                         max_controls=3, vl_own_area=True, encoding="edit-plus")

#: Every variant by name, in the order the CLI and messages list them.
VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant(name="edit", title="Qwen-Image-Edit", pipeline_class="QwenImageEditPipeline",
            template=templates.EDIT_TEMPLATE, image_prefix="", drop=templates.EDIT_DROP, max_controls=1,
            vl_own_area=False, zero_cond_t=False, encoding="edit"),
    Variant(name="edit-plus", title="Qwen-Image-Edit-2509 (Edit Plus)", zero_cond_t=False, **_EDIT_PLUS_COMMON),
    Variant(name="edit-2511", title="Qwen-Image-Edit-2511 (Edit Plus, zero_cond_t)", zero_cond_t=True,
            **_EDIT_PLUS_COMMON),
    Variant(name="image-2.1", title="Qwen-Image-2.1", pipeline_class="QwenImage21Pipeline",
            template=templates.QWEN21_TEMPLATE, image_prefix=templates.QWEN21_IMAGE_PREFIX,
            image_separator=templates.QWEN21_IMAGE_SEPARATOR, drop=None, max_controls=QWEN_IMAGE_21.max_references,
            vl_own_area=False, zero_cond_t=False, encoding="qwen-image-2.1", family=QWEN_IMAGE_21),
)}

#: Each variant by its own name, for code that means one release (the toy model is an Edit model).
EDIT, EDIT_PLUS, EDIT_2511 = VARIANTS["edit"], VARIANTS["edit-plus"], VARIANTS["edit-2511"]
IMAGE_21 = VARIANTS["image-2.1"]
#: The accepted names (config `model.variant`, CLI `--variant`).
NAMES: tuple[str, ...] = tuple(VARIANTS)
#: The variant a new tiny model or an unspecified CLI choice gets.
DEFAULT = EDIT.name


def toy_variants() -> tuple[str, ...]:
    """The variants the built-in tiny and toy models are built as (`Toy.variant`), one per family that has them,
    in the families' order: what `qwen-edit tiny --pretrained` and `qwen-edit demo` accept."""
    return tuple(f.toy.variant for f in FAMILIES.values() if f.toy is not None)


def get(name: str) -> Variant:
    """The variant called `name`; an unknown name raises UnknownVariantError listing the accepted ones."""
    try:
        return VARIANTS[name]
    except KeyError:
        raise UnknownVariantError(f"unknown variant {name!r}; accepted: {', '.join(NAMES)}") from None


def from_pipeline(pipeline_class: str, zero_cond_t: bool = False) -> Variant:
    """The variant of a diffusers pipeline class and transformer `zero_cond_t` flag."""
    for variant in VARIANTS.values():
        if variant.pipeline_class == pipeline_class and variant.zero_cond_t == bool(zero_cond_t):
            return variant
    classes = ", ".join(dict.fromkeys(v.pipeline_class for v in VARIANTS.values()))
    titles = ", ".join(v.title for v in VARIANTS.values())
    raise UnknownVariantError(f"a {pipeline_class or 'unknown'} model; accepted: {classes} ({titles})")


def from_model_dir(model_dir: Path) -> Variant:
    """The variant of a diffusers-layout directory: `model_index.json`'s pipeline class and, where present,
    `transformer/config.json`'s `zero_cond_t`."""
    model_dir = Path(model_dir)
    index = json.loads((model_dir / "model_index.json").read_text())
    transformer = model_dir / "transformer" / "config.json"
    zero_cond_t = json.loads(transformer.read_text()).get("zero_cond_t", False) if transformer.is_file() else False
    try:
        return from_pipeline(index.get("_class_name", ""), zero_cond_t)
    except UnknownVariantError as err:
        raise UnknownVariantError(f"{str(model_dir)!r} holds {err}") from None


def zero_cond_t_in_file(keys: Iterable[str]) -> bool:
    """Whether a single transformer file's (prefix-stripped) keys carry the Edit-2511 marker."""
    return ZERO_COND_MARKER in set(keys)
