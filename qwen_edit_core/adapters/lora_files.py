"""LoRA files: read every common layout (ComfyUI, kohya/lycoris, peft/diffusers) into one in-memory form.

`read_lora_file` / `parse_lora_state_dict` turn a safetensors LoRA in any layout of `LAYOUTS` into `LoraWeights`
(module path -> down, up, alpha, float32 on the CPU); `map_to_modules` resolves kohya/lycoris underscored names
against a model's dotted module paths; `save_lora` writes an injected peft adapter in ComfyUI's layout. The key
rules (prefixes, down/up vs lora_A/lora_B, alpha / rank) are ComfyUI's and diffusers' (adapters/lora.py's
docstring, docs/MODEL.md). LoKr, LoHa and DoRA layers (adapters/lycoris_files.py) are read and written in the
keys stock ComfyUI's weight adapters read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from qwen_edit_core.adapters.lycoris_files import (CONV_ONLY_KEYS, LOHA_KEYS, LOKR_KEYS, LohaLayer, LokrLayer,
                                                   dora_scale_for, dora_weight, lycoris_layer)
from qwen_edit_core.common.files import save_safetensors
from qwen_edit_core.common.names import rename

if TYPE_CHECKING:
    from qwen_edit_core.adapters.lora import LoraSpec

SAVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LAYOUTS = ("diffusion_model.P.lora_down/lora_up.weight (+ .alpha) (ComfyUI)", "P.lora_down/lora_up.weight",
           "P.lora_A/lora_B.weight (peft, diffusers)", "transformer.P.lora_A/lora_B.weight",
           "P.lora_A.default.weight / base_model.model.P... (peft)",
           "lora_unet_P_with_underscores.lora_down/lora_up.weight (+ .alpha) (kohya)", "lycoris_P_with_underscores",
           "P.lokr_w1/lokr_w2 or their _a/_b factors (+ .alpha) (LoKr)",
           "P.hada_w1_a/hada_w1_b/hada_w2_a/hada_w2_b (+ .alpha) (LoHa)", "a LoRA + P.dora_scale (DoRA)")
_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "base_model.model.", "transformer.", "unet.")
_UNDERSCORED_PREFIXES = ("lora_unet_", "lycoris_")
_KEY = re.compile(r"^(?P<module>.+?)\.(?P<kind>lora_down|lora_up|lora_A|lora_B)(?:\.[A-Za-z0-9_\-]+)?\.weight$"
                  r"|^(?P<bare>.+?)\.(?P<bkind>lora_A|lora_B)$"
                  r"|^(?P<amodule>.+?)\.alpha$"
                  rf"|^(?P<xmodule>.+?)\.(?P<xkind>{'|'.join(LOKR_KEYS + LOHA_KEYS + CONV_ONLY_KEYS)}|dora_scale)$")
_KINDS = {"lora_down": "down", "lora_A": "down", "lora_up": "up", "lora_B": "up"}


@dataclass(frozen=True)
class LoraLayer:
    """One module's LoRA as a file holds it: delta W = scale * up @ down; with a `dora_scale` (out, 1) it is a
    DoRA layer, whose weight ComfyUI computes from the base weight (`lycoris_files.dora_weight`)."""
    down: torch.Tensor  # (r, in)
    up: torch.Tensor    # (out, r)
    alpha: float | None
    dora_scale: torch.Tensor | None = None
    kind = "lora"

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def scale(self) -> float:
        """alpha / rank when the file has an alpha, else 1.0 (as ComfyUI and diffusers do)."""
        return 1.0 if self.alpha is None else self.alpha / self.rank

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in) of the weight the layer changes."""
        return self.up.shape[0], self.down.shape[1]

    def delta(self) -> torch.Tensor:
        """scale * up @ down (for DoRA: the direction's change before the magnitude)."""
        return self.scale * self.up @ self.down

    def tensors(self) -> dict[str, torch.Tensor]:
        extra = {} if self.dora_scale is None else {"dora_scale": self.dora_scale}
        return {"lora_down.weight": self.down, "lora_up.weight": self.up, **extra}


#: a file's layer of any kind
FileLayer = LoraLayer | LokrLayer | LohaLayer


@dataclass(frozen=True)
class LoraWeights:
    """A LoRA file's layers by module path, and its safetensors metadata."""
    layers: dict[str, FileLayer]
    metadata: dict[str, str] = field(default_factory=dict)
    #: True while some module paths are still underscored (kohya/lycoris): `map_to_modules` resolves them
    underscored: bool = False


def read_lora_file(path) -> LoraWeights:
    """Read a LoRA file in any layout of `LAYOUTS` into module path -> (down, up, alpha), float32 on the CPU."""
    from safetensors import safe_open
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


def _split_key(key: str) -> tuple[str, str, bool] | None:
    """key -> (module path, "down" | "up" | "alpha", underscored), or None for a key in no known layout."""
    name, underscored = key, False
    for prefix in _UNDERSCORED_PREFIXES:
        if name.startswith(prefix):
            name, underscored = name[len(prefix):], True
            break
    else:
        stripped = True
        while stripped:  # e.g. base_model.model.transformer.P
            stripped = False
            for prefix in _PREFIXES:
                if name.startswith(prefix):
                    name, stripped = name[len(prefix):], True
    match = _KEY.match(name)
    if match is None:
        return None
    if match.group("xmodule"):
        return match.group("xmodule"), match.group("xkind"), underscored
    if match.group("amodule"):
        return match.group("amodule"), "alpha", underscored
    if match.group("bare"):
        return match.group("bare"), _KINDS[match.group("bkind")], underscored
    return match.group("module"), _KINDS[match.group("kind")], underscored


def _group_keys(tensors: dict[str, torch.Tensor], source: str) -> tuple[dict[str, dict[str, str]], bool]:
    """{module: {"down"/"up"/"alpha": key}}; unknown keys and two keys for one slot are errors."""
    parts: dict[str, dict[str, str]] = {}
    unknown, underscored = [], False
    for key in tensors:
        split = _split_key(key)
        if split is None:
            unknown.append(key)
            continue
        module, kind, under = split
        underscored |= under
        slot = parts.setdefault(module, {})
        if kind in slot:
            raise ValueError(f"{source}: keys {slot[kind]!r} and {key!r} both give the {kind} weight of module "
                             f"{module!r}")
        slot[kind] = key
    if unknown:
        raise ValueError(f"{source}: keys in no known LoRA layout: {unknown[:4]}"
                         f"{f' (and {len(unknown) - 4} more)' if len(unknown) > 4 else ''}; accepted layouts: "
                         + "; ".join(LAYOUTS))
    return parts, underscored


def _layer_from(tensors: dict[str, torch.Tensor], keys: dict[str, str], module: str, source: str) -> FileLayer:
    for kind, key in keys.items():
        if not bool(torch.isfinite(tensors[key].float()).all()):
            raise ValueError(f"{source}: key {key!r} holds NaN or Inf values; the file is damaged or came "
                             "from a diverged training run, so it is refused (use an earlier checkpoint)")
    if "alpha" in keys and tensors[keys["alpha"]].numel() != 1:
        raise ValueError(f"{source}: key {keys['alpha']!r} holds {tensors[keys['alpha']].numel()} values; an alpha "
                         "is one number (the file is damaged)")
    alpha = float(tensors[keys["alpha"]].float().reshape(-1)[0]) if "alpha" in keys else None
    lycoris = {k: v for k, v in keys.items() if k in LOKR_KEYS + LOHA_KEYS + CONV_ONLY_KEYS}
    if lycoris:
        other = [v for k, v in keys.items() if k not in lycoris and k != "alpha"]
        if other:
            raise ValueError(f"{source}: module {module!r} mixes LoKr/LoHa keys ({next(iter(lycoris.values()))!r}) "
                             f"with {other[0]!r}")
        return lycoris_layer(tensors, lycoris, alpha, module, source)
    for have, need, names in (("down", "up", "lora_up/lora_B"), ("up", "down", "lora_down/lora_A")):
        if need not in keys:
            present = keys.get(have) or keys.get("alpha") or keys["dora_scale"]
            raise ValueError(f"{source}: key {present!r} has no {names} partner (module {module!r})")
    down, up = tensors[keys["down"]], tensors[keys["up"]]
    if down.dim() != 2 or up.dim() != 2 or up.shape[1] != down.shape[0]:
        raise ValueError(f"{source}: {keys['down']!r} is {tuple(down.shape)} and {keys['up']!r} is "
                         f"{tuple(up.shape)}; expected down (r, in) and up (out, r) with the same r")
    dora = tensors[keys["dora_scale"]].detach().float().cpu() if "dora_scale" in keys else None
    if dora is not None and (dora.shape[0] != up.shape[0] or dora.numel() != up.shape[0]):
        raise ValueError(f"{source}: {keys['dora_scale']!r} is {tuple(dora.shape)}; this loader takes DoRA scales "
                         f"per output row ({up.shape[0]}, 1) only (stock ComfyUI also reads per-input ones)")
    return LoraLayer(down.detach().float().cpu(), up.detach().float().cpu(), alpha,
                     None if dora is None else dora.reshape(-1, 1))


def parse_lora_state_dict(tensors: dict[str, torch.Tensor], metadata: dict | None = None,
                          source: str = "state dict") -> LoraWeights:
    """A LoRA state dict in any layout of `LAYOUTS` -> `LoraWeights` (see `read_lora_file`)."""
    parts, underscored = _group_keys(tensors, source)
    layers = {module: _layer_from(tensors, keys, module, source) for module, keys in parts.items()}
    if not layers:
        raise ValueError(f"{source}: no LoRA weights found; accepted layouts: " + "; ".join(LAYOUTS))
    return LoraWeights(layers, dict(metadata or {}), underscored)


def map_to_modules(weights: LoraWeights, module_names: Sequence[str]) -> LoraWeights:
    """Resolve underscored (kohya/lycoris) module names against the model's real dotted names; dotted names
    pass through. A name that matches no module, or two, is an error."""
    if not weights.underscored:
        return weights
    lookup: dict[str, str | None] = {}
    for name in module_names:
        key = name.replace(".", "_")
        lookup[key] = None if key in lookup and lookup[key] != name else name
    dotted, unknown = rename(weights.layers, lambda name: lookup.get(name.replace(".", "_")))
    if unknown:
        raise ValueError(f"LoRA modules {unknown[:4]} match no module of this transformer (or several): a LoRA "
                         "for another model?")
    return LoraWeights({dotted[name]: weights.layers[name] for name in dotted}, weights.metadata, False)


#: ComfyUI's Qwen-Image-2.1 model fuses each block's SwiGLU input projections into one `img_mlp.gate_up` weight,
#: [gate_layer; proj] stacked on the output axis (docs/MODEL.md); LoRAs trained on that layout name it
FUSED_MLP, FUSED_HALVES = "img_mlp.gate_up", ("img_mlp.gate_layer", "img_mlp.proj")


def fused_mlp_names(module_names: Sequence[str]) -> list[str]:
    """The fused `...img_mlp.gate_up` paths of a model whose blocks hold `gate_layer` and `proj` (2.1)."""
    names = set(module_names)
    gate, proj = FUSED_HALVES
    return [n[: -len(gate)] + FUSED_MLP for n in module_names
            if n.endswith("." + gate) and n[: -len(gate)] + proj in names]


def unfuse_mlp(weights: LoraWeights) -> LoraWeights:
    """A LoRA on the fused `img_mlp.gate_up` as two LoRAs on `gate_layer` and `proj`: the same down, the up's
    first and second halves of rows (DoRA scales split alike), so each half's delta is the rows of the fused delta
    ComfyUI applies to it. LoKr/LoHa layers on the fused weight are refused (their delta does not split)."""
    layers = {}
    for name, layer in weights.layers.items():
        if not name.endswith("." + FUSED_MLP) and name != FUSED_MLP:
            layers[name] = layer
            continue
        if layer.kind != "lora":
            raise ValueError(f"{name}: a {layer.kind} layer on ComfyUI's fused 2.1 MLP weight cannot be split into "
                             "gate_layer and proj; train it on the split layers (this project's layout)")
        half, base = layer.up.shape[0] // 2, name[: -len(FUSED_MLP)]
        scales = (None, None) if layer.dora_scale is None else (layer.dora_scale[:half], layer.dora_scale[half:])
        for suffix, rows, dora in zip(FUSED_HALVES, (slice(0, half), slice(half, None)), scales):
            layers[base + suffix] = LoraLayer(layer.down, layer.up[rows].contiguous(), layer.alpha, dora)
    return LoraWeights(layers, weights.metadata, weights.underscored)


#: `train.lora_format`: "split" writes each MLP half under its own name (diffusers, DiffSynth and peft read it, and
#: ComfyUI maps it onto its fused weight); "fused" writes ComfyUI's own layout (`diffusion_model.` keys, one
#: `img_mlp.gate_up` LoRA per block), as ComfyUI's and ai-toolkit's trainers do. docs/TRAINING.md, "The LoRA file".
LORA_FORMATS = ("split", "fused")


def _block_rows(top: torch.Tensor | None, bottom: torch.Tensor | None) -> torch.Tensor:
    """[top 0; 0 bottom] for two up matrices (a missing one is a zero block of the other's rows)."""
    top = top if top is not None else torch.zeros(bottom.shape[0], 0)
    bottom = bottom if bottom is not None else torch.zeros(top.shape[0], 0)
    return torch.block_diag(top, bottom)


def fuse_mlp_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI-layout LoRA tensors with each block's `gate_layer` and `proj` LoRAs as one LoRA on the fused
    `img_mlp.gate_up` (`unfuse_mlp` reads it back): downs stacked, ups block-diagonal, so the fused delta's rows
    are exactly the two halves' deltas. Equal scales stay in `alpha` (no tensor changes); unequal ones are folded
    into the ups. DoRA scales are stacked; LoKr/LoHa layers are refused (their deltas do not stack)."""
    gate, proj = FUSED_HALVES
    groups: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    out = {}
    for key, value in tensors.items():
        match = re.match(rf"(.*\.)({re.escape(gate)}|{re.escape(proj)})\.(.+)$", key)
        if match is None:
            out[key] = value
            continue
        base, half, suffix = match.groups()
        groups.setdefault(base, {}).setdefault(half, {})[suffix] = value
    for base, halves in groups.items():
        if any(set(t) - {"lora_down.weight", "lora_up.weight", "alpha", "dora_scale"} for t in halves.values()):
            raise ValueError(f"{base}{FUSED_MLP}: LoKr/LoHa layers cannot be written in the fused layout; use "
                             "train.lora_format 'split'")
        if len({"dora_scale" in t for t in halves.values()}) > 1:
            raise ValueError(f"{base}{FUSED_MLP}: DoRA on one MLP half only cannot be fused; use train.lora_format "
                             "'split'")
        parts = [halves.get(h) for h in FUSED_HALVES]
        scales = [None if t is None else float(t["alpha"]) / t["lora_down.weight"].shape[0] for t in parts]
        known = {s for s in scales if s is not None}
        fold = len(known) > 1
        ups = [None if t is None else t["lora_up.weight"] * (s if fold else 1.0) for t, s in zip(parts, scales)]
        down = torch.cat([t["lora_down.weight"] for t in parts if t is not None])
        up = _block_rows(*ups)
        if parts[0] is None:  # only proj trained: its rows are the second half
            up = torch.cat([torch.zeros_like(ups[1]), ups[1]])
        elif parts[1] is None:
            up = torch.cat([ups[0], torch.zeros_like(ups[0])])
        fused = {"lora_down.weight": down, "lora_up.weight": up,
                 "alpha": torch.tensor(down.shape[0] * (1.0 if fold else known.pop()), dtype=torch.float32)}
        if all(t is not None and "dora_scale" in t for t in parts):
            fused["dora_scale"] = torch.cat([parts[0]["dora_scale"], parts[1]["dora_scale"]])
        elif any(t is not None and "dora_scale" in t for t in parts):
            raise ValueError(f"{base}{FUSED_MLP}: DoRA on one MLP half only cannot be fused; use train.lora_format "
                             "'split'")
        out.update({f"{base}{FUSED_MLP}.{suffix}": value for suffix, value in fused.items()})
    return {(k if k.startswith("diffusion_model.") else "diffusion_model." + k): v for k, v in out.items()}


def check_fusable(transformer) -> None:
    """Refuse `train.lora_format` "fused" for a model without ComfyUI's fused MLP (no gate_layer/proj pairs)."""
    if not fused_mlp_names([module_path(n) for n, _ in transformer.named_modules()]):
        raise ValueError("train.lora_format 'fused': this model has no fused MLP layout (its blocks hold no "
                         "gate_layer/proj pair); use 'split'")


# -- writing ---------------------------------------------------------------------------------------------------
def module_path(name: str) -> str:
    """A module's path without peft's `base_layer` parts (adapters of several kinds nest on one layer)."""
    return ".".join(part for part in name.split(".") if part != "base_layer")


def peft_kind(layer) -> str:
    """"lora", "lokr" or "loha": the kind of a peft tuner layer."""
    from peft.tuners.lora import LoraLayer as PeftLoraLayer
    from peft.tuners.lokr import LoKrLayer
    return "lora" if isinstance(layer, PeftLoraLayer) else "lokr" if isinstance(layer, LoKrLayer) else "loha"


def adapter_layers(transformer, adapter_name: str = "default") -> dict[str, torch.nn.Module]:
    """{module path: peft layer holding adapter `adapter_name`} (LoRA/DoRA, LoKr or LoHa layers)."""
    from peft.tuners.lora import LoraLayer as PeftLoraLayer
    from peft.tuners.lycoris_utils import LycorisLayer
    return {module_path(name): m for name, m in transformer.named_modules()
            if isinstance(m, (PeftLoraLayer, LycorisLayer)) and adapter_name in m.r}


def base_scale(layer, adapter_name: str) -> float:
    """The layer's scale for the adapter before any `set_adapters` weight: alpha / r (alpha / sqrt(r) rsLoRA)."""
    r = layer.r[adapter_name]
    if peft_kind(layer) != "lora":
        return layer.alpha[adapter_name] / r
    alpha = layer.lora_alpha[adapter_name]
    return alpha / r ** 0.5 if layer.use_rslora.get(adapter_name, False) else alpha / r


_base_scale = base_scale


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().cpu()


def layer_file_tensors(layer, adapter_name: str) -> dict[str, torch.Tensor]:
    """{key suffix: float32 CPU tensor} of one peft layer, in the keys and scale rules stock ComfyUI reads
    (adapters/lycoris_files.py): the weight ComfyUI patches equals the one peft computes."""
    kind, scale = peft_kind(layer), base_scale(layer, adapter_name)
    if kind == "lora":
        down, up = _cpu(layer.lora_A[adapter_name].weight), _cpu(layer.lora_B[adapter_name].weight)
        out = {"lora_down.weight": down, "lora_up.weight": up,
               "alpha": torch.tensor(scale * down.shape[0], dtype=torch.float32)}
        if layer.use_dora.get(adapter_name, False):
            magnitude = layer.lora_magnitude_vector[adapter_name].weight
            out["dora_scale"] = dora_scale_for(_cpu(layer.get_base_layer().weight), scale * up @ down, _cpu(magnitude))
        return out
    names = LOKR_KEYS if kind == "lokr" else LOHA_KEYS
    out = {n: _cpu(getattr(layer, n)[adapter_name]) for n in names if adapter_name in getattr(layer, n)}
    dim = next((out[n].shape[0] for n in ("lokr_w2_b", "lokr_w1_b", "hada_w1_b") if n in out), None)
    if dim is None:  # LoKr with full factors: ComfyUI applies scale 1, so the scale goes into w1
        out["lokr_w1"] = out["lokr_w1"] * scale
    else:
        out["alpha"] = torch.tensor(scale * dim, dtype=torch.float32)
    return out


def key_prefix(transformer) -> str:
    """The prefix of a saved file's keys: the transformer's family's `lora_prefix` (`diffusion_model.` for the
    2025 family; none for Qwen-Image-2.1, whose `gate_layer` / `proj` LoRAs stock ComfyUI maps onto its fused
    `gate_up` weight only under a bare, `transformer.` or `lycoris_` name (comfy/lora.py), and whose bare keys
    diffusers' Qwen converter reads). docs/MODEL.md, "Qwen-Image-2.1"."""
    from qwen_edit_core.families import family_of
    return family_of(transformer).lora_prefix


def lora_state_dict_comfy(transformer, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """ComfyUI-layout tensors of one adapter (float32 copies on the CPU), keys `<key_prefix>P.<suffix>`:
    LoRA `lora_down.weight`, `lora_up.weight` and `alpha` = scale * rank (so `alpha / rank * up @ down` is the
    delta peft applies), plus `dora_scale` for DoRA; LoKr and LoHa factors (`layer_file_tensors`). DoRA's scale
    reads the base weight: blocks offloaded to host memory are read there (`speed.base_in_host_memory`)."""
    from qwen_edit_core import speed
    prefix = key_prefix(transformer)
    with speed.base_in_host_memory(transformer):
        return {f"{prefix}{path}.{suffix}": tensor
                for path, layer in adapter_layers(transformer, adapter_name).items()
                for suffix, tensor in layer_file_tensors(layer, adapter_name).items()}


def effective_delta(layer: FileLayer, base: torch.Tensor | None = None, strength: float = 1.0) -> torch.Tensor:
    """The weight change stock ComfyUI applies for one file layer at `strength` (float32); a DoRA layer needs
    the `base` weight it patches."""
    if getattr(layer, "dora_scale", None) is None:
        return strength * layer.delta()
    if base is None:
        raise ValueError("a DoRA layer's weight change depends on the base weight: pass base=")
    return dora_weight(base, layer.delta(), layer.dora_scale, strength) - base.float()


def save_lora(path, transformer, spec: LoraSpec, *, base_identity: str, steps: int,
              extra_metadata: dict | None = None, adapter_name: str = "default",
              dtype: torch.dtype = torch.float32, layout: str = "split") -> Path:
    """Write adapter `adapter_name` as a ComfyUI/diffusers LoRA file, atomically (a temporary file in the same
    folder, then a rename: an existing file is replaced whole or left as it was).

    `dtype` is the matrices' dtype: float32 (default, exact) or bfloat16/float16 (half the size); `.alpha` and
    DoRA's `.dora_scale` stay float32. Metadata (all strings): format, architecture, type (lora/lokr/loha), dora,
    rank, alpha, targets (JSON), base_identity, steps, layout (when fused), then `extra_metadata` (which cannot
    override those).
    `layout` (LORA_FORMATS): "fused" writes ComfyUI's fused MLP layout (`fuse_mlp_tensors`), for a model whose
    blocks hold `gate_layer` and `proj`."""
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"LoRA save dtype {dtype} is not accepted; accepted: {', '.join(map(str, SAVE_DTYPES))}")
    if layout not in LORA_FORMATS:
        raise ValueError(f"train.lora_format {layout!r} is not accepted; accepted: {', '.join(LORA_FORMATS)}")
    tensors = lora_state_dict_comfy(transformer, adapter_name)
    if layout == "fused":
        check_fusable(transformer)
        tensors = fuse_mlp_tensors(tensors)
    tensors = {k: v if k.endswith((".alpha", ".dora_scale")) else v.to(dtype) for k, v in tensors.items()}
    if not tensors:
        raise ValueError(f"the transformer has no LoRA adapter {adapter_name!r} to save")
    metadata = {str(k): str(v) for k, v in (extra_metadata or {}).items()}
    from qwen_edit_core.families import family_of
    metadata.update({"format": "comfyui-lora", "architecture": family_of(transformer).name, "type": spec.type,
                     "dora": str(spec.dora).lower(), "rank": str(spec.rank),
                     "alpha": str(float(spec.alpha)), "targets": json.dumps(list(spec.targets)),
                     "base_identity": str(base_identity), "steps": str(int(steps))})
    if layout != "split":
        metadata["layout"] = layout
    return save_safetensors(tensors, Path(path), metadata=metadata)
