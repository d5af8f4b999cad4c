"""The 2025 Qwen-Image family's transformer file layout (`Family.file_layout`): ComfyUI's file keys are diffusers'
module names already, and the architecture is told from the file's shapes against the shipped table
(model/architectures/transformer_architectures.json). model/single_file.py reads the files (prefixes, scaled
fp8, the header) for every family.
"""

from __future__ import annotations

import json
import logging
import re

import torch

from qwen_edit_core.families import DEFAULT, family_of_file
from qwen_edit_core.model.single_file import ARCHITECTURES, SingleFileError

log = logging.getLogger(__name__)


def detect_config(tensors: dict[str, torch.Tensor], flags: dict, source: str = "file") -> dict:
    """The diffusers config of a Qwen-Image transformer state dict, from its shapes."""
    other = family_of_file(tensors)
    if other.file_layout != __name__:  # another family's file (its `file_marker`)
        raise SingleFileError(f"{source}: a {other.file_title} transformer, not a {DEFAULT.file_title} one: give it "
                              f"with a {other.file_title} model directory, which loads it as its family's")
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
    known = {n: c for n, c in json.loads(ARCHITECTURES.read_text()).items() if "_family" not in c}  # 2025 family
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


#: its text encoder is read from ComfyUI's single file (families/qwen_image/text_encoder_file.py): no refusal
TEXT_ENCODER_REFUSAL = ""


#: a file's keys are diffusers' already
def to_model(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A module's file tensors under the model's keys: unchanged (the 2025 files use diffusers' module names)."""
    return tensors
