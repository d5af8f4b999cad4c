"""LoRA adapters through peft: inject, save (ComfyUI + diffusers compatible), read every common layout,
load with a strength, stack several, merge and unmerge.

The file we write: `diffusion_model.<module path>.lora_down.weight` (= peft lora_A, (r, in)),
`.lora_up.weight` (= lora_B, (out, r)) and `.alpha` (float32 scalar), plus safetensors metadata. Module paths
are diffusers' (`transformer_blocks.0.attn.to_q`), which are also ComfyUI's for Qwen-Image.
- Stock ComfyUI (comfy/lora.py `model_lora_keys_unet` + `load_lora`, comfy/weight_adapter/lora.py) maps
  `diffusion_model.P` to the weight `diffusion_model.P.weight` and applies `W += strength * alpha / rank *
  up @ down`, with rank = down.shape[0]; without an `.alpha` key the scale is 1. It never reads metadata.
- diffusers' Qwen loader (`QwenImageLoraLoaderMixin.lora_state_dict` ->
  `_convert_non_diffusers_qwen_lora_to_diffusers`) strips `diffusion_model.`, renames down/up to lora_A/B and
  folds alpha / rank into the two matrices, then loads them with scale 1. Same effect in both.

Several LoRAs at sampling time are separate peft adapters activated together with per-adapter weights
(`apply_loras`, `activate`), not deltas merged into the base weights: the base stays untouched (so a graph can
switch stacks and a trainer can continue an adapter), and `merge_lora` / `unmerge_lora` fold the active stack
in and out when speed matters (peft's merge; unmerge subtracts the same delta, exact up to float rounding).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from qwen_edit_core import speed
from qwen_edit_core.common.files import save_safetensors

log = logging.getLogger(__name__)

_ATTN = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
TARGET_PRESETS: dict[str, tuple[str, ...]] = {
    "attn": _ATTN,
    "attn-img": ("to_q", "to_k", "to_v", "to_out.0"),
    "all": _ATTN + ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"),
}
INITS = ("default", "gaussian")
SAVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LAYOUTS = ("diffusion_model.P.lora_down/lora_up.weight (+ .alpha) (ComfyUI)", "P.lora_down/lora_up.weight",
           "P.lora_A/lora_B.weight (peft, diffusers)", "transformer.P.lora_A/lora_B.weight",
           "P.lora_A.default.weight / base_model.model.P... (peft)",
           "lora_unet_P_with_underscores.lora_down/lora_up.weight (+ .alpha) (kohya)", "lycoris_P_with_underscores")
_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "base_model.model.", "transformer.", "unet.")
_UNDERSCORED_PREFIXES = ("lora_unet_", "lycoris_")
_KEY = re.compile(r"^(?P<module>.+?)\.(?P<kind>lora_down|lora_up|lora_A|lora_B)(?:\.[A-Za-z0-9_\-]+)?\.weight$"
                  r"|^(?P<bare>.+?)\.(?P<bkind>lora_A|lora_B)$"
                  r"|^(?P<amodule>.+?)\.alpha$")
_KINDS = {"lora_down": "down", "lora_A": "down", "lora_up": "up", "lora_B": "up"}
# Parts of module paths that peft adds inside a wrapped layer: never LoRA targets themselves.
_PEFT_PARTS = frozenset({"base_layer", "lora_A", "lora_B", "lora_dropout", "lora_embedding_A", "lora_embedding_B",
                         "lora_magnitude_vector"})


# -- targets and injection -----------------------------------------------------------------------------------
def resolve_targets(spec: str | Sequence[str]) -> tuple[str, ...]:
    """A preset name ("attn", "attn-img", "all"), a comma-separated string, or a list of module-name suffixes
    (preset names inside a list expand). Whether each suffix matches a module is checked by `inject_lora`."""
    if isinstance(spec, str):
        if spec in TARGET_PRESETS:
            return TARGET_PRESETS[spec]
        if "," not in spec:
            raise ValueError(f"LoRA targets {spec!r}: not a preset; presets: {', '.join(TARGET_PRESETS)}, "
                             "or give a list of module names such as [to_q, to_k]")
        spec = [s.strip() for s in spec.split(",") if s.strip()]
    targets: list[str] = []
    for item in spec:
        for target in TARGET_PRESETS.get(str(item), (str(item),)):
            if target not in targets:
                targets.append(target)
    if not targets:
        raise ValueError(f"LoRA targets: empty list; presets: {', '.join(TARGET_PRESETS)}")
    return tuple(targets)


@dataclass(frozen=True)
class LoraSpec:
    """What to train: rank, alpha (scale alpha / rank), target module-name suffixes, dropout, and peft's
    `init_lora_weights` ("default": kaiming A and zero B; "gaussian": normal A and zero B)."""
    rank: int = 16
    alpha: float = 16.0
    targets: tuple[str, ...] = TARGET_PRESETS["attn"]
    dropout: float = 0.0
    init: str = "default"

    def __post_init__(self):
        if isinstance(self.targets, str) or not isinstance(self.targets, tuple):
            object.__setattr__(self, "targets", resolve_targets(self.targets))
        if int(self.rank) != self.rank or self.rank < 1:
            raise ValueError(f"LoRA rank must be an integer >= 1, got {self.rank!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if self.init not in INITS:
            raise ValueError(f"LoRA init {self.init!r} is not accepted; accepted: {', '.join(INITS)}")


#: layers a LoRA can sit on: plain Linears and the fp8 base layers of speed.quantize_fp8
_BASE_TYPES = (torch.nn.Linear, speed.Fp8Linear)


def _lora_config(**kwargs):
    """A peft LoraConfig that also wraps `speed.Fp8Linear` bases, with peft's own LoRA Linear layer (it needs
    only the base's forward, `in_features` and `out_features`; peft/tuners/lora/config.py
    `_register_custom_module`, its documented extension point for layer types peft does not know)."""
    from peft import LoraConfig
    from peft.tuners.lora.layer import Linear as PeftLoraLinear
    config = LoraConfig(**kwargs)
    config._register_custom_module({speed.Fp8Linear: PeftLoraLinear})
    return config


def _add_adapter(transformer, config, adapter_name: str) -> None:
    """diffusers' `add_adapter`, without peft's "unsupported layer type" warning for our fp8 base layers
    (supported through `_lora_config`'s mapping)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Unsupported layer type .*Fp8Linear")
        transformer.add_adapter(config, adapter_name=adapter_name)


def adaptable_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{module path: its base Linear} for every Linear a LoRA can sit on; a peft-wrapped layer counts under its
    own path (its base_layer and lora_A/lora_B children are not listed)."""
    out = {}
    for name, module in model.named_modules():
        if _PEFT_PARTS.intersection(name.split(".")):
            continue
        base = getattr(module, "base_layer", None)
        if isinstance(base, _BASE_TYPES):
            out[name] = base
        elif isinstance(module, _BASE_TYPES):
            out[name] = module
    return out


def _matching_modules(model: torch.nn.Module, targets: Sequence[str]) -> list[str]:
    """Full paths of the Linear modules whose path equals a target or ends with "." + target."""
    names = list(adaptable_modules(model))
    hits = {t: [n for n in names if n == t or n.endswith("." + t)] for t in targets}
    unmatched = [t for t, found in hits.items() if not found]
    if unmatched:
        raise ValueError(f"LoRA target(s) {unmatched} match no Linear module of the transformer; presets: "
                         f"{', '.join(TARGET_PRESETS)}; examples of module names: {', '.join(names[:6])}")
    wanted = {n for found in hits.values() for n in found}
    return [n for n in names if n in wanted]


def _refuse_inference_tensors(model: torch.nn.Module) -> None:
    bad = next((n for n, p in model.named_parameters() if p.is_inference()), None)
    if bad is not None:
        raise RuntimeError(f"the transformer's weight {bad!r} is an inference tensor (created or loaded under "
                           "torch.inference_mode, as in every ComfyUI node): autograd cannot train through it. "
                           "Load the model under torch.inference_mode(False) (qwen_edit_core.model.components does).")


def inject_lora(transformer, spec: LoraSpec, adapter_name: str = "default") -> None:
    """Add a trainable peft LoRA adapter `adapter_name` in place (diffusers' `add_adapter`) and make it the only
    active one; its parameters require grad, everything else is frozen. Targets are matched against full module
    paths (`to_out.0` hits `attn.to_out.0` only), and the adapter is created on exactly those paths.

    LoRA A is initialised from torch's global RNG: seed it for reproducible runs."""
    modules = _matching_modules(transformer, spec.targets)
    _refuse_inference_tensors(transformer)
    config = _lora_config(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                        init_lora_weights=True if spec.init == "default" else "gaussian", target_modules=modules)
    _add_adapter(transformer, config, adapter_name)
    trainable = {id(p) for layer in adapter_layers(transformer, adapter_name).values()
                 for p in (*layer.lora_A[adapter_name].parameters(), *layer.lora_B[adapter_name].parameters())}
    for param in transformer.parameters():
        param.requires_grad_(id(param) in trainable)
    log.info("LoRA adapter %r: rank %d, alpha %g on %d modules", adapter_name, spec.rank, spec.alpha, len(modules))


def adapter_layers(transformer, adapter_name: str = "default") -> dict[str, torch.nn.Module]:
    """{module path: peft LoRA layer} of one adapter."""
    from peft.tuners.lora import LoraLayer as PeftLoraLayer
    return {name: m for name, m in transformer.named_modules()
            if isinstance(m, PeftLoraLayer) and adapter_name in m.lora_A}


def _base_scale(layer, adapter_name: str) -> float:
    """The layer's scale for the adapter before any `set_adapters` weight: alpha / r (alpha / sqrt(r) rsLoRA)."""
    r = layer.r[adapter_name]
    alpha = layer.lora_alpha[adapter_name]
    return alpha / r ** 0.5 if layer.use_rslora.get(adapter_name, False) else alpha / r


# -- saving ----------------------------------------------------------------------------------------------------
def lora_state_dict_comfy(transformer, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """ComfyUI-layout tensors of one adapter (float32 copies on the CPU): `diffusion_model.P.lora_down.weight`,
    `.lora_up.weight` and `.alpha` = scale * rank (the adapter's alpha), so `alpha / rank * up @ down` is the
    delta peft applies."""
    out = {}
    for path, layer in adapter_layers(transformer, adapter_name).items():
        rank = layer.r[adapter_name]
        out[f"diffusion_model.{path}.lora_down.weight"] = layer.lora_A[adapter_name].weight.detach().float().cpu()
        out[f"diffusion_model.{path}.lora_up.weight"] = layer.lora_B[adapter_name].weight.detach().float().cpu()
        out[f"diffusion_model.{path}.alpha"] = torch.tensor(_base_scale(layer, adapter_name) * rank,
                                                            dtype=torch.float32)
    return out


def save_lora(path, transformer, spec: LoraSpec, *, base_identity: str, steps: int,
              extra_metadata: dict | None = None, adapter_name: str = "default",
              dtype: torch.dtype = torch.float32) -> Path:
    """Write adapter `adapter_name` as a ComfyUI/diffusers LoRA file, atomically (a temporary file in the same
    folder, then a rename: an existing file is replaced whole or left as it was).

    `dtype` is the matrices' dtype: float32 (default, exact) or bfloat16/float16 (half the size); `.alpha`
    stays float32. Metadata (all strings): format, architecture, rank, alpha, targets (JSON), base_identity,
    steps, then `extra_metadata` (which cannot override those)."""
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"LoRA save dtype {dtype} is not accepted; accepted: {', '.join(map(str, SAVE_DTYPES))}")
    tensors = {k: v if k.endswith(".alpha") else v.to(dtype)
               for k, v in lora_state_dict_comfy(transformer, adapter_name).items()}
    if not tensors:
        raise ValueError(f"the transformer has no LoRA adapter {adapter_name!r} to save")
    metadata = {str(k): str(v) for k, v in (extra_metadata or {}).items()}
    metadata.update({"format": "comfyui-lora", "architecture": "qwen-image", "rank": str(spec.rank),
                     "alpha": str(float(spec.alpha)), "targets": json.dumps(list(spec.targets)),
                     "base_identity": str(base_identity), "steps": str(int(steps))})
    return save_safetensors(tensors, Path(path), metadata=metadata)


# -- reading ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoraLayer:
    """One module's LoRA as a file holds it: delta W = scale * up @ down."""
    down: torch.Tensor  # (r, in)
    up: torch.Tensor    # (out, r)
    alpha: float | None

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def scale(self) -> float:
        """alpha / rank when the file has an alpha, else 1.0 (as ComfyUI and diffusers do)."""
        return 1.0 if self.alpha is None else self.alpha / self.rank


@dataclass(frozen=True)
class LoraWeights:
    """A LoRA file's layers by module path, and its safetensors metadata."""
    layers: dict[str, LoraLayer]
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


def _layer_from(tensors: dict[str, torch.Tensor], keys: dict[str, str], module: str, source: str) -> LoraLayer:
    for have, need, names in (("down", "up", "lora_up/lora_B"), ("up", "down", "lora_down/lora_A")):
        if need not in keys:
            present = keys.get(have) or keys["alpha"]
            raise ValueError(f"{source}: key {present!r} has no {names} partner (module {module!r})")
    down, up = tensors[keys["down"]], tensors[keys["up"]]
    if down.dim() != 2 or up.dim() != 2 or up.shape[1] != down.shape[0]:
        raise ValueError(f"{source}: {keys['down']!r} is {tuple(down.shape)} and {keys['up']!r} is "
                         f"{tuple(up.shape)}; expected down (r, in) and up (out, r) with the same r")
    alpha = float(tensors[keys["alpha"]].float().reshape(-1)[0]) if "alpha" in keys else None
    return LoraLayer(down.detach().float().cpu(), up.detach().float().cpu(), alpha)


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
    layers, unknown = {}, []
    for name, layer in weights.layers.items():
        dotted = lookup.get(name.replace(".", "_"))
        if dotted is None:
            unknown.append(name)
        else:
            layers[dotted] = layer
    if unknown:
        raise ValueError(f"LoRA modules {unknown[:4]} match no module of this transformer (or several): a LoRA "
                         "for another model?")
    return LoraWeights(layers, weights.metadata, False)


def check_against(transformer, weights: LoraWeights) -> LoraWeights:
    """Resolve underscored names, then check every layer's module exists and its shapes fit. Returns the
    resolved weights; raises ValueError naming the first mismatches and the expected shapes."""
    modules = adaptable_modules(transformer)
    weights = map_to_modules(weights, list(modules))
    problems = []
    for name, layer in weights.layers.items():
        module = modules.get(name)
        if module is None:
            problems.append(f"{name}: no such module")
            continue
        if (layer.up.shape[0], layer.down.shape[1]) != (module.out_features, module.in_features):
            problems.append(f"{name}: down {tuple(layer.down.shape)} / up {tuple(layer.up.shape)}, expected down "
                            f"(r, {module.in_features}) / up ({module.out_features}, r)")
    if problems:
        raise ValueError(f"LoRA does not fit this transformer (a LoRA for another model?): {problems[:4]}"
                         f"{f' (and {len(problems) - 4} more)' if len(problems) > 4 else ''}")
    return weights


# -- loading into peft adapters ----------------------------------------------------------------------------
def _adapter_names(transformer) -> set[str]:
    return set(getattr(transformer, "peft_config", None) or {})


def _tuner_layers(transformer) -> list:
    from peft.tuners.tuners_utils import BaseTunerLayer
    return [m for m in transformer.modules() if isinstance(m, BaseTunerLayer)]


def _active_adapters(transformer) -> list[str]:
    """The adapters the model runs now (none when adapters are disabled), in activation order."""
    names: list[str] = []
    for layer in _tuner_layers(transformer):
        if layer.disable_adapters:
            return []
        names += [n for n in layer.active_adapters if n not in names]
    return names


def _pattern_config(values: dict[str, float]) -> tuple[float, dict[str, float]]:
    """(the most common value, {exact-path regex: value} for the others): peft's rank/alpha patterns."""
    common = Counter(values.values()).most_common(1)[0][0]
    return common, {f"^{re.escape(n)}$": v for n, v in values.items() if v != common}


def _new_adapter(transformer, weights: LoraWeights, adapter_name: str, strength: float) -> None:
    """Create a peft adapter shaped like the file (per-module ranks; alpha = file scale * rank * strength)."""
    rank, rank_pattern = _pattern_config({n: layer.rank for n, layer in weights.layers.items()})
    alpha, alpha_pattern = _pattern_config({n: layer.scale * layer.rank * strength
                                            for n, layer in weights.layers.items()})
    config = _lora_config(r=int(rank), lora_alpha=alpha, target_modules=list(weights.layers),
                        rank_pattern=rank_pattern, alpha_pattern=alpha_pattern)
    with torch.random.fork_rng(devices=[]):  # the init is overwritten: do not consume the caller's RNG
        _add_adapter(transformer, config, adapter_name)
    layers = adapter_layers(transformer, adapter_name)
    with torch.no_grad():
        for name, layer in weights.layers.items():
            layers[name].lora_A[adapter_name].weight.copy_(layer.down)
            layers[name].lora_B[adapter_name].weight.copy_(layer.up)


def _into_existing(transformer, weights: LoraWeights, adapter_name: str, strength: float) -> None:
    """Copy the file into an existing adapter, keeping the adapter's rank and alpha: the file's scale is folded
    into B, and adapter layers the file lacks get B = 0 (no effect until trained)."""
    layers = adapter_layers(transformer, adapter_name)
    outside = [n for n in weights.layers if n not in layers]
    wrong_rank = [f"{n}: file rank {layer.rank}, adapter rank {layers[n].r[adapter_name]}"
                  for n, layer in weights.layers.items() if n in layers and layer.rank != layers[n].r[adapter_name]]
    zero_scale = [n for n, layer in layers.items() if _base_scale(layer, adapter_name) == 0]
    if outside or wrong_rank or zero_scale:
        raise ValueError(f"the LoRA file does not fit adapter {adapter_name!r}: modules it does not target "
                         f"{outside[:4]}, rank mismatches {wrong_rank[:4]}, alpha 0 on {zero_scale[:4]}; match "
                         "model.lora rank/targets to the file")
    with torch.no_grad():
        for name, peft_layer in layers.items():
            up_param = peft_layer.lora_B[adapter_name].weight
            if name not in weights.layers:
                up_param.zero_()
                continue
            layer = weights.layers[name]
            peft_layer.lora_A[adapter_name].weight.copy_(layer.down)
            up_param.copy_(layer.up * (layer.scale * strength / _base_scale(peft_layer, adapter_name)))
    if len(layers) > len(weights.layers):
        log.info("adapter %r: %d of its modules are not in the file and start from zero", adapter_name,
                 len(layers) - len(weights.layers))


def load_lora_into(transformer, weights: LoraWeights, adapter_name: str = "default", strength: float = 1.0) -> None:
    """Load file weights into peft adapter `adapter_name` with `strength` folded into its scale.

    A new adapter is created with the file's ranks and targets and activated beside the adapters already
    active. An existing adapter (e.g. one `inject_lora` made for training) keeps its rank, alpha and
    activation and receives the file's weights, so training continues from the file; the file must fit it.
    Active adapters' parameters require grad (peft's convention): run sampling under torch.no_grad."""
    weights = check_against(transformer, weights)
    unmerge_lora(transformer)  # weights change below: a merged delta would go stale
    if adapter_name in _adapter_names(transformer):
        _into_existing(transformer, weights, adapter_name, strength)
        return
    previous = _active_adapters(transformer)
    _new_adapter(transformer, weights, adapter_name, strength)
    if not previous:
        transformer.enable_adapters()
    for layer in _tuner_layers(transformer):
        layer.set_adapter(previous + [adapter_name])


def weights_adapter_name(weights: LoraWeights) -> str:
    """A stable adapter name for in-memory weights: a digest of their paths, shapes, alphas and values."""
    digest = hashlib.sha1()
    for name in sorted(weights.layers):
        layer = weights.layers[name]
        digest.update(f"{name}:{layer.alpha}:{tuple(layer.down.shape)}:{tuple(layer.up.shape)}".encode())
        for tensor in (layer.down, layer.up):
            digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return "w_" + digest.hexdigest()[:12]


def file_adapter_name(path) -> str:
    """A stable adapter name for a LoRA file (its path, size and modification time)."""
    path = Path(path)
    stat = path.stat()
    return "f_" + hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]


def use_adapters(transformer, names: Sequence[str], strengths: Sequence[float]) -> None:
    """Make exactly `names` active with per-adapter `strengths` (multiplying each adapter's own scale); no names
    turns every adapter off. Unmerges first: a merged stack cannot change."""
    unmerge_lora(transformer)
    combined: dict[str, float] = {}
    for name, strength in zip(names, strengths):
        combined[name] = combined.get(name, 0.0) + float(strength)
    if combined:
        transformer.enable_adapters()
        transformer.set_adapters(list(combined), weights=list(combined.values()))
    elif _adapter_names(transformer):
        transformer.disable_adapters()


def apply_loras(transformer, loras: Sequence[tuple[LoraWeights, float]]) -> list[str]:
    """Sample with several LoRAs: each becomes its own peft adapter (loaded once, named by its content), then
    exactly these are activated with their strengths (the deltas add: W + sum strength_i * delta_i). Other
    adapters stay loaded but inactive. Returns the adapter names in order."""
    names, strengths = [], []
    for weights, strength in loras:
        name = weights_adapter_name(weights)
        if name not in _adapter_names(transformer):
            load_lora_into(transformer, weights, adapter_name=name, strength=1.0)
        names.append(name)
        strengths.append(float(strength))
    use_adapters(transformer, names, strengths)
    return names


def activate(transformer, stack: Sequence[tuple[str, float]]) -> None:
    """Make exactly the LoRA files of `stack` ((path, strength) pairs) active, loading each file once; an empty
    stack turns every adapter off. Lets several graphs share one transformer with different LoRAs."""
    names, strengths = [], []
    for path, strength in stack:
        name = file_adapter_name(path)
        if name not in _adapter_names(transformer):
            load_lora_into(transformer, read_lora_file(path), adapter_name=name, strength=1.0)
        names.append(name)
        strengths.append(float(strength))
    use_adapters(transformer, names, strengths)


def lora_delta(weights: LoraWeights, module: str) -> torch.Tensor:
    """The weight change one layer applies at strength 1: scale * up @ down."""
    layer = weights.layers[module]
    return layer.scale * layer.up @ layer.down


def merge_lora(transformer) -> None:
    """Fold the active adapters, at their current strengths, into the base weights (faster sampling, no LoRA
    matmuls); `unmerge_lora` restores the base. Do not train or change the stack while merged."""
    if any(isinstance(m, speed.Fp8Linear) for m in transformer.modules()):
        raise ValueError("merge_lora: the transformer's base is in fp8 (speed.quantize_fp8, predict.fp8); a LoRA "
                         "cannot be folded into it. Sample unmerged (the LoRA runs beside the fp8 base) or "
                         "reload the model without fp8")
    for layer in _tuner_layers(transformer):
        if not layer.disable_adapters:
            layer.merge()


def unmerge_lora(transformer) -> None:
    """Undo `merge_lora` (subtracts the merged deltas: exact up to float rounding)."""
    for layer in _tuner_layers(transformer):
        if layer.merged:
            layer.unmerge()
