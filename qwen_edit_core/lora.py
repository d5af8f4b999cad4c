"""LoRA adapters through peft: inject, save (ComfyUI + diffusers compatible), read every common layout,
load with a strength, merge and unmerge.

The file we write: `diffusion_model.<module path>.lora_down.weight` (= peft lora_A), `.lora_up.weight`
(= lora_B) and `.alpha`, plus safetensors metadata. Stock ComfyUI applies `alpha / rank * up @ down`
(comfy/lora.py reads `.alpha`, never the metadata); diffusers' Qwen loader folds `alpha / rank` into the
weights (lora_conversion_utils `_convert_non_diffusers_qwen_lora_to_diffusers`). Same effect in both.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from safetensors import safe_open

from .atomic import save_safetensors

log = logging.getLogger(__name__)

_ATTN = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
TARGET_PRESETS: dict[str, tuple[str, ...]] = {
    "attn": _ATTN,
    "attn-img": ("to_q", "to_k", "to_v", "to_out.0"),
    "all": _ATTN + ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"),
}
INITS = ("default", "gaussian")
LAYOUTS = ("diffusion_model.P.lora_down/lora_up(.alpha) (ComfyUI)", "P.lora_A/lora_B (peft, diffusers)",
           "transformer.P.lora_A/lora_B", "base_model.model.P.lora_A.default", "lora_unet_P_with_underscores (kohya)",
           "lycoris_P_with_underscores")
_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "base_model.model.", "transformer.", "unet.")
_SUFFIX = re.compile(r"^(?P<module>.+?)\.(?P<kind>lora_down|lora_up|lora_A|lora_B)(?:\.[A-Za-z0-9_]+)?\.weight$"
                     r"|^(?P<amodule>.+?)\.alpha$")


def resolve_targets(spec: str | Sequence[str]) -> tuple[str, ...]:
    """A preset name ("attn", "attn-img", "all") or explicit module-name suffixes."""
    if isinstance(spec, str):
        if spec in TARGET_PRESETS:
            return TARGET_PRESETS[spec]
        if "," in spec:
            return tuple(s.strip() for s in spec.split(",") if s.strip())
        raise ValueError(f"LoRA targets {spec!r}: not a preset; presets: {', '.join(TARGET_PRESETS)}, "
                         "or give a list of module names such as [to_q, to_k]")
    targets = tuple(str(s) for s in spec)
    if not targets:
        raise ValueError("LoRA targets: empty list")
    return targets


@dataclass(frozen=True)
class LoraSpec:
    rank: int = 16
    alpha: float = 16.0
    targets: tuple[str, ...] = TARGET_PRESETS["attn"]
    dropout: float = 0.0
    init: str = "default"


def _matching_modules(model: torch.nn.Module, targets: Sequence[str]) -> list[str]:
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched:
        raise ValueError(f"LoRA target(s) {unmatched} match no Linear module of the transformer; examples of "
                         f"module names: {', '.join(names[:6])}")
    return [n for n in names if any(n == t or n.endswith("." + t) for t in targets)]


def inject_lora(transformer, spec: LoraSpec, adapter_name: str = "default") -> None:
    """Add a trainable peft LoRA adapter in place; the base stays frozen."""
    from peft import LoraConfig
    if spec.init not in INITS:
        raise ValueError(f"LoRA init {spec.init!r} is not accepted; accepted: {', '.join(INITS)}")
    if spec.rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {spec.rank}")
    base = next(transformer.parameters())
    if base.is_inference():
        raise RuntimeError("the transformer's weights are inference tensors (loaded under torch.inference_mode); "
                           "load it with qwen_edit_core.components, which loads outside inference mode")
    modules = _matching_modules(transformer, spec.targets)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                        init_lora_weights=True if spec.init == "default" else "gaussian",
                        target_modules=modules)
    transformer.add_adapter(config, adapter_name=adapter_name)
    for name, param in transformer.named_parameters():
        param.requires_grad_(f".{adapter_name}." in name and "lora_" in name)


def adapter_layers(transformer, adapter_name: str = "default") -> dict[str, torch.nn.Module]:
    """{module path: peft LoRA layer} of one adapter."""
    from peft.tuners.lora import LoraLayer
    return {name: m for name, m in transformer.named_modules()
            if isinstance(m, LoraLayer) and adapter_name in m.lora_A}


def lora_state_dict_comfy(transformer, alpha: float, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """ComfyUI-layout tensors of one adapter (float32 copies on the CPU)."""
    out = {}
    for path, layer in adapter_layers(transformer, adapter_name).items():
        out[f"diffusion_model.{path}.lora_down.weight"] = layer.lora_A[adapter_name].weight.detach().float().cpu()
        out[f"diffusion_model.{path}.lora_up.weight"] = layer.lora_B[adapter_name].weight.detach().float().cpu()
        out[f"diffusion_model.{path}.alpha"] = torch.tensor(float(alpha))
    return out


def save_lora(path, transformer, spec: LoraSpec, *, base_identity: str, steps: int,
              extra_metadata: dict | None = None, adapter_name: str = "default",
              dtype: torch.dtype = torch.float32) -> Path:
    """Write the adapter as a ComfyUI/diffusers LoRA file, atomically."""
    path = Path(path)
    tensors = {k: (v.to(dtype) if not k.endswith(".alpha") else v)
               for k, v in lora_state_dict_comfy(transformer, spec.alpha, adapter_name).items()}
    if not tensors:
        raise ValueError(f"the transformer has no LoRA adapter {adapter_name!r} to save")
    metadata = {"format": "comfyui-lora", "rank": str(spec.rank), "alpha": str(spec.alpha),
                "targets": json.dumps(list(spec.targets)), "base_identity": base_identity, "steps": str(steps),
                "architecture": "qwen-image", **{k: str(v) for k, v in (extra_metadata or {}).items()}}
    return save_safetensors(tensors, path, metadata=metadata)


@dataclass(frozen=True)
class LoraLayer:
    down: torch.Tensor  # (r, in)
    up: torch.Tensor    # (out, r)
    alpha: float | None

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def scale(self) -> float:
        """alpha / rank when the file has an alpha, else 1.0 (as ComfyUI)."""
        return 1.0 if self.alpha is None else self.alpha / self.rank


@dataclass(frozen=True)
class LoraWeights:
    layers: dict[str, LoraLayer]
    metadata: dict[str, str] = field(default_factory=dict)
    #: True when module paths are still underscored (kohya/lycoris) and need `map_to_modules`
    underscored: bool = False


def read_lora_file(path) -> LoraWeights:
    """Read a LoRA in any common layout (see LAYOUTS) into module path -> (down, up, alpha)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"LoRA file {str(path)!r} does not exist")
    try:
        with safe_open(str(path), framework="pt") as fh:
            metadata = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as err:  # noqa: BLE001 - safetensors raises several types for damaged files
        raise ValueError(f"{str(path)!r} is not a readable safetensors LoRA file: {err}") from None
    return parse_lora_state_dict(tensors, metadata, source=str(path))


def parse_lora_state_dict(tensors: dict[str, torch.Tensor], metadata: dict | None = None,
                          source: str = "state dict") -> LoraWeights:
    parts: dict[str, dict[str, torch.Tensor]] = {}
    unknown = []
    underscored = False
    for key, value in tensors.items():
        name = key
        for prefix in ("lora_unet_", "lycoris_"):
            if name.startswith(prefix):
                name, underscored = name[len(prefix):], True
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        match = _SUFFIX.match(name)
        if match is None:
            unknown.append(key)
            continue
        if match.group("amodule"):
            parts.setdefault(match.group("amodule"), {})["alpha"] = value
        else:
            kind = {"lora_down": "down", "lora_A": "down", "lora_up": "up", "lora_B": "up"}[match.group("kind")]
            parts.setdefault(match.group("module"), {})[kind] = value
    if unknown:
        raise ValueError(f"{source}: keys in no known LoRA layout: {unknown[:4]}; accepted layouts: "
                         + "; ".join(LAYOUTS))
    layers = {}
    for module, found in parts.items():
        if "down" not in found or "up" not in found:
            missing = "up (lora_up/lora_B)" if "up" not in found else "down (lora_down/lora_A)"
            raise ValueError(f"{source}: module {module!r} has no {missing} weight")
        down, up = found["down"], found["up"]
        if down.dim() != 2 or up.dim() != 2 or up.shape[1] != down.shape[0]:
            raise ValueError(f"{source}: module {module!r} has down {tuple(down.shape)} and up {tuple(up.shape)}; "
                             "expected (r, in) and (out, r)")
        alpha = float(found["alpha"]) if "alpha" in found else None
        layers[module] = LoraLayer(down.float(), up.float(), alpha)
    if not layers:
        raise ValueError(f"{source}: no LoRA weights found")
    return LoraWeights(layers, dict(metadata or {}), underscored)


def map_to_modules(weights: LoraWeights, module_names: Sequence[str]) -> LoraWeights:
    """Resolve underscored (kohya) module names against the model's real dotted names."""
    if not weights.underscored:
        return weights
    lookup = {name.replace(".", "_"): name for name in module_names}
    layers, unknown = {}, []
    for name, layer in weights.layers.items():
        dotted = lookup.get(name.replace(".", "_"))
        if dotted is None:
            unknown.append(name)
        else:
            layers[dotted] = layer
    if unknown:
        raise ValueError(f"LoRA modules {unknown[:4]} exist in no module of this transformer: a LoRA for another "
                         "model?")
    return LoraWeights(layers, weights.metadata, False)


def check_against(transformer, weights: LoraWeights) -> LoraWeights:
    """Resolve names and check every layer's module exists and its shapes fit; errors list mismatches."""
    modules = dict(transformer.named_modules())
    linear = {n: m for n, m in modules.items() if isinstance(m, torch.nn.Linear) or hasattr(m, "base_layer")}
    weights = map_to_modules(weights, list(linear))
    problems = []
    for name, layer in weights.layers.items():
        module = linear.get(name)
        if module is None:
            problems.append(f"{name}: no such module")
            continue
        base = getattr(module, "base_layer", module)
        want = (base.out_features, base.in_features)
        got = (layer.up.shape[0], layer.down.shape[1])
        if got != want:
            problems.append(f"{name}: LoRA maps {got[1]} -> {got[0]}, the module {want[1]} -> {want[0]}")
    if problems:
        raise ValueError(f"LoRA does not fit this transformer (a LoRA for another model?): {problems[:4]}")
    return weights


def load_lora_into(transformer, weights: LoraWeights, adapter_name: str = "default", strength: float = 1.0) -> None:
    """Create adapter `adapter_name` with the file's ranks and scales times `strength`, set its weights, and
    activate it beside the other loaded adapters."""
    from peft import LoraConfig
    weights = check_against(transformer, weights)
    ranks = {n: layer.rank for n, layer in weights.layers.items()}
    alphas = {n: layer.scale * layer.rank * strength for n, layer in weights.layers.items()}
    first = next(iter(weights.layers))
    config = LoraConfig(r=ranks[first], lora_alpha=alphas[first], target_modules=list(weights.layers),
                        rank_pattern={f"^{re.escape(n)}$": r for n, r in ranks.items()},
                        alpha_pattern={f"^{re.escape(n)}$": a for n, a in alphas.items()})
    existing = set(getattr(transformer, "peft_config", {}) or {})
    transformer.add_adapter(config, adapter_name=adapter_name)
    layers = adapter_layers(transformer, adapter_name)
    with torch.no_grad():
        for name, layer in weights.layers.items():
            peft_layer = layers[name]
            peft_layer.lora_A[adapter_name].weight.copy_(layer.down)
            peft_layer.lora_B[adapter_name].weight.copy_(layer.up)
    transformer.set_adapters(sorted(existing | {adapter_name}))


def lora_delta(weights: LoraWeights, module: str) -> torch.Tensor:
    """The weight change a layer applies: scale * up @ down."""
    layer = weights.layers[module]
    return layer.scale * layer.up @ layer.down


def merge_lora(transformer) -> None:
    """Fold the active adapters into the base weights (faster sampling); `unmerge_lora` undoes it."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    for module in transformer.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()


def unmerge_lora(transformer) -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer
    for module in transformer.modules():
        if isinstance(module, BaseTunerLayer) and module.merged:
            module.unmerge()


def file_adapter_name(path) -> str:
    """A stable adapter name for a LoRA file (its path, size and modification time)."""
    import hashlib
    path = Path(path)
    stat = path.stat()
    return "f_" + hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]


def activate(transformer, stack: Sequence[tuple[str, float]]) -> None:
    """Make exactly the LoRA files of `stack` active with their strengths (loading each file once); an empty
    stack turns every adapter off. Lets several graphs share one transformer with different LoRAs."""
    loaded = set(getattr(transformer, "peft_config", {}) or {})
    names, weights = [], []
    for path, strength in stack:
        name = file_adapter_name(path)
        if name not in loaded:
            load_lora_into(transformer, read_lora_file(path), adapter_name=name, strength=1.0)
            loaded.add(name)
        names.append(name)
        weights.append(float(strength))
    if names:
        transformer.enable_adapters()
        transformer.set_adapters(names, weights=weights)
    elif loaded:
        transformer.disable_adapters()
