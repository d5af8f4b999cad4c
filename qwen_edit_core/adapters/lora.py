"""LoRA adapters through peft: inject, load with a strength, stack several, merge and unmerge. Reading every
common file layout and writing ours live in adapters/lora_files.py; this module re-exports them
(`lora.read_lora_file`, `lora.save_lora`, ...). The adapter kinds (`LoraSpec.type`: lora, lokr, loha; `dora`)
are peft's own (adapters/kinds.py); their files use the keys stock ComfyUI reads (adapters/lycoris_files.py).

The file we write: `diffusion_model.<module path>.lora_down.weight` (= peft lora_A, (r, in)),
`.lora_up.weight` (= lora_B, (out, r)) and `.alpha` (float32 scalar), plus safetensors metadata. Module paths
are diffusers' (`transformer_blocks.0.attn.to_q`), which are also ComfyUI's for Qwen-Image. Qwen-Image-2.1 files
use the bare module path (no prefix), and ComfyUI's fused 2.1 MLP (`img_mlp.gate_up`) is read onto our split
`gate_layer` / `proj` (lora_files.key_prefix, unfuse_mlp; docs/MODEL.md, "Qwen-Image-2.1").
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

import dataclasses
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from qwen_edit_core import speed
from qwen_edit_core.families import DEFAULT
from qwen_edit_core.adapters.kinds import (ADAPTER_TYPES, adapter_parameters, add_adapter, check_kind,  # noqa: F401
                                           into_existing, new_adapter, peft_config, refuse_fp8)
from qwen_edit_core.adapters.lora_files import (  # noqa: F401 - the file formats are part of this module's API
    LAYOUTS, LORA_FORMATS, SAVE_DTYPES, LoraLayer, LoraWeights, _base_scale, adapter_layers, check_fusable,
    effective_delta, fuse_mlp_tensors, fused_mlp_names,
    lora_state_dict_comfy, map_to_modules, parse_lora_state_dict, read_lora_file, save_lora, unfuse_mlp)

log = logging.getLogger(__name__)

#: the default family's presets (families/family.py holds each family's)
TARGET_PRESETS: dict[str, tuple[str, ...]] = dict(DEFAULT.lora_targets)
INITS = ("default", "gaussian")
# Parts of module paths that peft adds inside a wrapped layer: never LoRA targets themselves.
_PEFT_PARTS = frozenset({"base_layer", "lora_A", "lora_B", "lora_dropout", "lora_embedding_A", "lora_embedding_B",
                         "lora_magnitude_vector", "lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a",
                         "lokr_w2_b", "lokr_t2", "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1",
                         "hada_t2"})


# -- targets and injection -----------------------------------------------------------------------------------
def resolve_targets(spec: str | Sequence[str], presets=None) -> tuple[str, ...]:
    """A preset name ("attn", "attn-img", "all"), a comma-separated string, or a list of module-name suffixes
    (preset names inside a list expand). Whether each suffix matches a module is checked by `inject_lora`.
    `presets`: a model family's `lora_targets` (default: the 2025 family's)."""
    TARGET_PRESETS = dict(presets) if presets is not None else globals()["TARGET_PRESETS"]
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
    `init_lora_weights` ("default": kaiming A and zero B; "gaussian": normal A and zero B); `type` "lora", "lokr"
    (Kronecker factors) or "loha" (Hadamard product of two low-rank pairs), `dora` (LoRA only: a learned magnitude
    per output row, peft's use_dora). Dropout and the gaussian init are LoRA options."""
    rank: int = 16
    alpha: float = 16.0
    targets: tuple[str, ...] = TARGET_PRESETS["attn"]
    dropout: float = 0.0
    init: str = "default"
    type: str = "lora"
    dora: bool = False

    def __post_init__(self):
        if isinstance(self.targets, str) or not isinstance(self.targets, tuple):
            object.__setattr__(self, "targets", resolve_targets(self.targets))
        if int(self.rank) != self.rank or self.rank < 1:
            raise ValueError(f"LoRA rank must be an integer >= 1, got {self.rank!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if self.init not in INITS:
            raise ValueError(f"LoRA init {self.init!r} is not accepted; accepted: {', '.join(INITS)}")
        check_kind(self.type, self.dora, dropout=self.dropout, init=self.init)


#: layers a LoRA can sit on: plain Linears and the fp8 base layers of speed.quantize_fp8
_BASE_TYPES = (torch.nn.Linear, speed.Fp8Linear)


def adaptable_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{module path: its base Linear} for every Linear a LoRA can sit on; a peft-wrapped layer counts under its
    own path (its base_layer and adapter children are not listed; nested peft layers reach the same base)."""
    out = {}
    for name, module in model.named_modules():
        if _PEFT_PARTS.intersection(name.split(".")):
            continue
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else None
        if isinstance(base, _BASE_TYPES):
            out[name] = base
        elif isinstance(module, _BASE_TYPES):
            out[name] = module
    return out


def split_parameter_name(name: str) -> tuple[str, str]:
    """(module path, adapter suffix) of an adapter parameter's name: "blocks.0.attn.to_q.lora_A.default.weight"
    -> ("blocks.0.attn.to_q", "lora_A.default.weight")."""
    parts = name.split(".")
    at = next((i for i, part in enumerate(parts) if part in _PEFT_PARTS), len(parts))
    return ".".join(parts[:at]), ".".join(parts[at:])


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


def unreached_modules(transformer: torch.nn.Module) -> frozenset[str]:
    """Full paths of the Linear modules whose output reaches no loss: the family's `unreached_in_last_block`
    suffixes inside the transformer's last block (found from its block list, so any depth). A LoRA there would
    get no gradient: `inject_lora` leaves them out."""
    from qwen_edit_core.families import family_of
    family = family_of(transformer)
    blocks = getattr(transformer, family.blocks, None)
    if not family.unreached_in_last_block or not blocks:
        return frozenset()
    last = f"{family.blocks}.{len(blocks) - 1}."
    return frozenset(last + suffix for suffix in family.unreached_in_last_block)


def _refuse_inference_tensors(model: torch.nn.Module) -> None:
    bad = next((n for n, p in model.named_parameters() if p.is_inference()), None)
    if bad is not None:
        raise RuntimeError(f"the transformer's weight {bad!r} is an inference tensor (created or loaded under "
                           "torch.inference_mode, as in every ComfyUI node): autograd cannot train through it. "
                           "Load the model under torch.inference_mode(False) (qwen_edit_core.model.components does).")


def inject_lora(transformer, spec: LoraSpec, adapter_name: str = "default") -> None:
    """Add a trainable peft adapter `adapter_name` of `spec.type` (LoRA, DoRA, LoKr, LoHa) in place (diffusers'
    `add_adapter`) and make it the only active one; its parameters require grad, everything else is frozen.
    Targets are matched against full module paths (`to_out.0` hits `attn.to_out.0` only), and the adapter is
    created on exactly those paths.

    Modules whose output reaches no loss (`unreached_modules`: the last block's text stream in the 2025 family)
    are left out, so every trained parameter gets a gradient.

    The initial factors are drawn from torch's global RNG: seed it for reproducible runs."""
    matched = _matching_modules(transformer, spec.targets)
    unreached = unreached_modules(transformer)
    modules = [m for m in matched if m not in unreached]
    if not modules:
        raise ValueError(f"LoRA targets {list(spec.targets)} match only {matched[:4]}, whose output reaches no "
                         "loss (the last block's text stream is discarded); target other modules")
    _refuse_inference_tensors(transformer)
    refuse_fp8(transformer, modules, spec.type, spec.dora)
    config = peft_config(spec.type, r=spec.rank, alpha=spec.alpha, targets=modules, dora=spec.dora,
                         dropout=spec.dropout, init=spec.init)
    with speed.base_in_host_memory(transformer):  # blocks a planned load left in host memory: the real base
        add_adapter(transformer, config, adapter_name)
    dora_norms_on_device(transformer, adapter_name)
    use_adapters(transformer, [adapter_name], [1.0])  # on, even where a removed adapter left the layers off
    train_only(transformer, adapter_name)
    log.info("%s adapter %r: rank %d, alpha %g on %d modules%s", f"{spec.type}{' + DoRA' if spec.dora else ''}",
             adapter_name, spec.rank, spec.alpha, len(modules),
             f" ({len(matched) - len(modules)} left out: their output reaches no loss)" if len(matched) > len(modules)
             else "")


def dora_norms_on_device(transformer, adapter_name: str) -> None:
    """Recompute adapter `adapter_name`'s DoRA magnitudes (the base rows' norms) of the layers of offloaded blocks
    on the offloader's device, one layer's temporary base copy at a time, with peft's own code: peft made them
    beside the host copy, on the CPU, and bf16 norms may round otherwise there than on a resident layer.

    The norm is taken with A and B in the base's dtype, as a resident layer's is: peft 0.21.2
    (tuners/lora/layer.py `update_layer`) moves the adapter to the base's device and dtype just before it, so an
    adapter cast afterwards (e.g. upcast to float32) still gets the same number."""
    for layer in adapter_layers(transformer, adapter_name).values():
        if adapter_name not in getattr(layer, "lora_magnitude_vector", {}):
            continue
        base = layer.get_base_layer()
        with speed.layer_on_device(transformer, base) as moved:
            if not moved:  # resident: peft computed it on the device already
                continue
            dtype = base.weight.dtype if base.weight.dtype.is_floating_point else None
            magnitude = layer.lora_magnitude_vector[adapter_name]
            fresh = type(magnitude)(fan_in_fan_out=magnitude.fan_in_fan_out)
            fresh.update_layer(base_layer=base, lora_A=layer.lora_A[adapter_name].weight.to(dtype=dtype),
                               lora_B=layer.lora_B[adapter_name].weight.to(dtype=dtype),
                               scaling=layer.scaling[adapter_name])
            with torch.no_grad():
                magnitude.weight.copy_(fresh.weight)


def train_only(transformer, adapter_name: str = "default") -> None:
    """Make adapter `adapter_name`'s tensors (LoRA A, B, DoRA magnitude; LoKr/LoHa factors) the only parameters
    that require grad (peft makes every active adapter trainable whenever adapters are activated: call this after
    each activation while training)."""
    trainable = {id(p) for layer in adapter_layers(transformer, adapter_name).values()
                 for p in adapter_parameters(layer, adapter_name)}
    for param in transformer.parameters():
        param.requires_grad_(id(param) in trainable)


def check_family(transformer, weights: LoraWeights) -> None:
    """ValueError naming both families when the file was trained for another model family than `transformer`'s
    (a Qwen-Image-2.1 LoRA on a 2509 model: some module names match, the effect would be noise)."""
    from qwen_edit_core.families import family_of
    if "architecture" not in weights.metadata:  # another tool's file: its module names and shapes are checked instead
        return
    try:
        trained_for = family_of(weights.metadata)
    except KeyError:  # a family this code does not know: its module names and shapes are checked instead
        return
    family = family_of(transformer)
    if trained_for is not family:
        raise ValueError(f"the LoRA was trained for {trained_for.title} and this model is {family.title}; apply it "
                         f"to a {trained_for.title} model")


def check_against(transformer, weights: LoraWeights) -> LoraWeights:
    """Resolve underscored names, then check every layer's module exists and its shapes fit. Returns the
    resolved weights; raises ValueError naming the first mismatches and the expected shapes. A file that records
    the model family it was trained for (our `architecture` metadata) must be for this model's family."""
    check_family(transformer, weights)
    modules = adaptable_modules(transformer)
    # ComfyUI's fused 2.1 MLP names resolve too, then split onto gate_layer and proj
    weights = unfuse_mlp(map_to_modules(weights, list(modules) + fused_mlp_names(list(modules))))
    problems = []
    for name, layer in weights.layers.items():
        module = modules.get(name)
        if module is None:
            problems.append(f"{name}: no such module")
            continue
        if tuple(layer.shape) == (module.out_features, module.in_features):
            continue
        if layer.kind == "lora":
            problems.append(f"{name}: down {tuple(layer.down.shape)} / up {tuple(layer.up.shape)}, expected down "
                            f"(r, {module.in_features}) / up ({module.out_features}, r)")
        else:
            problems.append(f"{name}: {layer.kind} of a {layer.shape[0]}x{layer.shape[1]} weight ("
                            + ", ".join(f"{k} {tuple(t.shape)}" for k, t in layer.tensors().items())
                            + f"), the module's is {module.out_features}x{module.in_features}")
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


def load_lora_into(transformer, weights: LoraWeights, adapter_name: str = "default", strength: float = 1.0) -> None:
    """Load file weights into peft adapter `adapter_name` with `strength` folded into its scale.

    A new adapter is created with the file's ranks and targets and activated beside the adapters already
    active. An existing adapter (e.g. one `inject_lora` made for training) keeps its rank, alpha and
    activation and receives the file's weights, so training continues from the file; the file must fit it.
    Active adapters' parameters require grad (peft's convention): run sampling under torch.no_grad."""
    weights = check_against(transformer, weights)
    unmerge_lora(transformer)  # weights change below: a merged delta would go stale
    with speed.base_in_host_memory(transformer):  # DoRA reads the base of blocks left in host memory
        _load_into(transformer, weights, adapter_name, strength)


def _load_into(transformer, weights: LoraWeights, adapter_name: str, strength: float) -> None:
    """`load_lora_into` once the weights are checked: into the existing adapter, else a new one, activated."""
    if adapter_name in _adapter_names(transformer):
        # a file trained before such modules were left out: their delta changes no output, so dropping it is exact
        unreached = unreached_modules(transformer).intersection(weights.layers)
        if unreached:
            log.info("adapter %r: %d layer(s) of the file whose output reaches no loss are left out: %s",
                     adapter_name, len(unreached), ", ".join(sorted(unreached)))
            weights = dataclasses.replace(weights, layers={k: v for k, v in weights.layers.items()
                                                           if k not in unreached})
        into_existing(transformer, weights, adapter_name, strength)
        return
    previous = _active_adapters(transformer)
    new_adapter(transformer, weights, adapter_name, strength)
    if not previous:
        transformer.enable_adapters()
    for layer in _tuner_layers(transformer):
        layer.set_adapter(previous + [adapter_name])


def load_lora_file(transformer, path, adapter_name: str = "default", strength: float = 1.0) -> None:
    """Read a LoRA file (any layout of `LAYOUTS`) and load it as adapter `adapter_name` (`load_lora_into`),
    outside inference mode so the adapter's weights are ordinary tensors even when called from ComfyUI."""
    weights = read_lora_file(path)
    with torch.inference_mode(False):
        load_lora_into(transformer, weights, adapter_name=adapter_name, strength=strength)


def weights_adapter_name(weights: LoraWeights) -> str:
    """A stable adapter name for in-memory weights: a digest of their paths, shapes, alphas and values."""
    digest = hashlib.sha1()
    for name in sorted(weights.layers):
        layer = weights.layers[name]
        tensors = layer.tensors()
        digest.update(f"{name}:{layer.kind}:{layer.alpha}:{[(k, tuple(t.shape)) for k, t in tensors.items()]}".encode())
        for tensor in tensors.values():
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
        speed.scales_as_inputs(transformer)  # compiled blocks take strengths as inputs: no recompile per change
    elif _adapter_names(transformer):
        transformer.disable_adapters()


def remove_adapter(transformer, name: str = "default") -> None:
    """Turn every adapter off and delete adapter `name` (diffusers' `delete_adapters`), e.g. the trained one
    once it is saved, from a transformer that stays in use; the LoRA files' adapters stay loaded."""
    use_adapters(transformer, [], [])
    if name in _adapter_names(transformer):
        transformer.delete_adapters([name])


def _member(transformer, name: str, strength: float, read) -> tuple[str, float]:
    """(adapter name, activation weight) of one stack entry, loading `read()` once as adapter `name`. LoRA, LoKr
    and LoHa deltas scale with the strength (activation weight = strength). A DoRA file is loaded once per
    strength other than 1, folded in (stock ComfyUI applies W + s * (W' - W), which no peft scale of one
    adapter gives), and activated with weight 1."""
    if name not in _adapter_names(transformer):
        load_lora_into(transformer, read(), adapter_name=name, strength=1.0)
    if strength == 1.0 or not getattr(transformer.peft_config[name], "use_dora", False):
        return name, float(strength)
    scaled = f"{name}_s{strength:g}".replace(".", "p").replace("-", "m")
    if scaled not in _adapter_names(transformer):
        load_lora_into(transformer, read(), adapter_name=scaled, strength=float(strength))
    return scaled, 1.0


def apply_loras(transformer, loras: Sequence[tuple[LoraWeights, float]]) -> list[str]:
    """Sample with several LoRAs: each becomes its own peft adapter (loaded once, named by its content), then
    exactly these are activated with their strengths (the deltas add: W + sum strength_i * delta_i). Other
    adapters stay loaded but inactive. Returns the adapter names in order."""
    members = [_member(transformer, weights_adapter_name(weights), strength, lambda w=weights: w)
               for weights, strength in loras]
    use_adapters(transformer, [n for n, _ in members], [s for _, s in members])
    return [n for n, _ in members]


def activate(transformer, stack: Sequence[tuple[str, float]]) -> None:
    """Make exactly the LoRA files of `stack` ((path, strength) pairs) active, loading each file once; an empty
    stack turns every adapter off. Lets several graphs share one transformer with different LoRAs."""
    members = [_member(transformer, file_adapter_name(path), strength, lambda p=path: read_lora_file(p))
               for path, strength in stack]
    use_adapters(transformer, [n for n, _ in members], [s for _, s in members])


def activate_with_trained(transformer, stack: Sequence[tuple[str, float]], trained: str = "default") -> None:
    """While training: the trained adapter (strength 1) and the LoRA files of `stack` ((path, strength) pairs,
    a path given twice keeps its last strength) active together; only the trained adapter requires grad, so the
    files stay frozen companions and a saved `trained` adapter holds none of them."""
    last = {path: strength for path, strength in stack}
    members = dict(_member(transformer, file_adapter_name(path), strength, lambda p=path: read_lora_file(p))
                   for path, strength in last.items())
    use_adapters(transformer, [trained, *members], [1.0, *members.values()])
    train_only(transformer, trained)


def lora_delta(weights: LoraWeights, module: str, base: torch.Tensor | None = None) -> torch.Tensor:
    """The weight change one layer applies at strength 1 as stock ComfyUI computes it (LoRA: scale * up @ down;
    LoKr, LoHa: their products; DoRA needs the `base` weight)."""
    return effective_delta(weights.layers[module], base)


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
