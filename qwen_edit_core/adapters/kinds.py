"""The adapter kinds on the peft side: LoRA (optionally DoRA), LoKr and LoHa.

`peft_config` builds peft's own LoraConfig(use_dora=...) / LoKrConfig / LoHaConfig; `new_adapter` creates an
adapter shaped like a file's layers; `into_existing` copies a file into an adapter already there (training
continues from it); `adapter_parameters` lists an adapter's trainable tensors of every kind. Files of every kind
load so that the model's weight equals what stock ComfyUI patches (adapters/lycoris_files.py), with the
strength folded in the same way ComfyUI applies it.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections import Counter
from contextlib import nullcontext

import torch

from qwen_edit_core import speed
from qwen_edit_core.adapters.lora_files import LoraWeights, adapter_layers, base_scale, peft_kind
from qwen_edit_core.adapters.lycoris_files import LOHA_KEYS, LOKR_KEYS, peft_dora_from, row_norm

log = logging.getLogger(__name__)

ADAPTER_TYPES = ("lora", "lokr", "loha")


def check_kind(kind: str, dora: bool, *, dropout: float = 0.0, init: str = "default") -> None:
    """`model.lora.type` / `model.lora.dora` and the options each kind takes; errors name the key."""
    if kind not in ADAPTER_TYPES:
        raise ValueError(f"model.lora.type {kind!r} is not accepted; accepted: {', '.join(ADAPTER_TYPES)}")
    if dora and kind != "lora":
        raise ValueError(f"model.lora.dora: true works with model.lora.type lora only, not {kind!r} (DoRA is a "
                         "LoRA with a learned magnitude per output row); set dora: false or type: lora")
    if kind != "lora" and dropout:
        raise ValueError(f"model.lora.dropout {dropout} applies to type lora; peft's {kind} has no such dropout: "
                         "set it to 0")
    if kind != "lora" and init != "default":
        raise ValueError(f"model.lora.init {init!r} applies to type lora; {kind} starts from peft's default init")


def _lora_config(**kwargs):
    """A peft LoraConfig that also wraps `speed.Fp8Linear` bases, with peft's own LoRA Linear layer (it needs
    only the base's forward, `in_features` and `out_features`; peft/tuners/lora/config.py
    `_register_custom_module`, its documented extension point for layer types peft does not know)."""
    from peft import LoraConfig
    from peft.tuners.lora.layer import Linear as PeftLoraLinear
    config = LoraConfig(**kwargs)
    config._register_custom_module({speed.Fp8Linear: PeftLoraLinear})
    return config


def peft_config(kind: str, *, r: int, alpha: float, targets: list[str], dora: bool = False, dropout: float = 0.0,
                init: str = "default", rank_pattern: dict | None = None, alpha_pattern: dict | None = None):
    """peft's config of one kind: scale alpha / r on every kind (peft's rule); LoKr's factor sizes are peft's
    default (decompose_factor -1: near the square root; w2 low-rank when r < half its side)."""
    patterns = {"rank_pattern": rank_pattern or {}, "alpha_pattern": alpha_pattern or {}}
    if kind == "lora":
        return _lora_config(r=r, lora_alpha=alpha, lora_dropout=dropout, use_dora=dora, target_modules=targets,
                            init_lora_weights=True if init == "default" else "gaussian", **patterns)
    from peft import LoHaConfig, LoKrConfig
    config_cls = LoKrConfig if kind == "lokr" else LoHaConfig
    return config_cls(r=r, alpha=alpha, target_modules=targets, init_weights=True, **patterns)


def refuse_fp8(transformer, modules: list[str], kind: str, dora: bool) -> None:
    """LoKr, LoHa and DoRA need the base weight itself, which an fp8 base layer (speed.Fp8Linear) does not
    expose: refuse them there with what to do."""
    if kind == "lora" and not dora:
        return
    named = dict(transformer.named_modules())
    fp8 = [m for m in modules if isinstance(getattr(named[m], "get_base_layer", lambda: named[m])(), speed.Fp8Linear)]
    if fp8:
        raise ValueError(f"{'DoRA' if dora else kind} on an fp8 base layer ({fp8[0]}) is not supported: load the "
                         "transformer with model.transformer_fp8: upcast (or predict without fp8), or use a plain LoRA")


def add_adapter(transformer, config, adapter_name: str) -> None:
    """diffusers' `add_adapter`, without peft's "unsupported layer type" warning for our fp8 base layers
    (supported through `_lora_config`'s mapping) or its note that a model holds several adapters (ours do)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Unsupported layer type .*Fp8Linear")
        warnings.filterwarnings("ignore", message=r"Already found a `peft_config` attribute")
        transformer.add_adapter(config, adapter_name=adapter_name)


def adapter_parameters(layer, adapter_name: str) -> list[torch.nn.Parameter]:
    """The trainable tensors of one adapter in one peft layer (LoRA A, B and DoRA's magnitude; LoKr's and LoHa's
    factors)."""
    params = []
    for attr in layer.adapter_layer_names:
        holder = getattr(layer, attr)
        if adapter_name in holder:
            item = holder[adapter_name]
            params += [item] if isinstance(item, torch.nn.Parameter) else list(item.parameters())
    return params


def _pattern_config(values: dict[str, float]) -> tuple[float, dict[str, float]]:
    """(the most common value, {exact-path regex: value} for the others): peft's rank/alpha patterns."""
    common = Counter(values.values()).most_common(1)[0][0]
    return common, {f"^{re.escape(n)}$": v for n, v in values.items() if v != common}


def _file_kind(weights: LoraWeights) -> tuple[str, bool]:
    kinds = {layer.kind for layer in weights.layers.values()}
    doras = {getattr(layer, "dora_scale", None) is not None for layer in weights.layers.values()}
    if len(kinds) > 1 or len(doras) > 1:
        raise ValueError(f"the LoRA file mixes adapter kinds ({', '.join(sorted(kinds))}"
                         f"{', DoRA and plain LoRA' if len(doras) > 1 else ''}) across its modules; this loader "
                         "takes one kind per file")
    return kinds.pop(), doras.pop()


def new_adapter(transformer, weights: LoraWeights, adapter_name: str, strength: float) -> None:
    """Create a peft adapter of the file's kind shaped like the file, holding the file's weights at `strength`
    (the weight equals stock ComfyUI's patch at that strength)."""
    kind, dora = _file_kind(weights)
    refuse_fp8(transformer, list(weights.layers), kind, dora)
    layers = weights.layers
    if kind == "lokr":  # r only picks the initial factor shapes, replaced below; alpha = the whole scale
        r, rank_pattern = 1, {}
        alpha, alpha_pattern = _pattern_config({n: lay.scale * strength for n, lay in layers.items()})
    else:
        r, rank_pattern = _pattern_config({n: lay.rank for n, lay in layers.items()})
        # DoRA: scale 1 in peft, the file's scale and strength go into B and the magnitude (peft_dora_from)
        alpha, alpha_pattern = _pattern_config({n: lay.rank * (1.0 if dora else lay.scale * strength)
                                                for n, lay in layers.items()})
    config = peft_config(kind, r=int(r), alpha=alpha, targets=list(layers), dora=dora, rank_pattern=rank_pattern,
                         alpha_pattern=alpha_pattern)
    with torch.random.fork_rng(devices=[]):  # the init is overwritten: do not consume the caller's RNG
        add_adapter(transformer, config, adapter_name)
    peft_layers = adapter_layers(transformer, adapter_name)
    with torch.no_grad():
        for name, layer in layers.items():
            with _dora_base_on_device(transformer, peft_layers[name], adapter_name):
                _write(peft_layers[name], adapter_name, layer, strength,
                       base_scale(peft_layers[name], adapter_name), replace=kind == "lokr")


def _dora_base_on_device(transformer, peft_layer, adapter_name: str):
    """While a DoRA layer's magnitude is computed from its base rows' norms: an offloaded block's base on a
    temporary device copy (`speed.layer_on_device`), where a resident layer's is, since float32 norms of the same
    rows may round otherwise on the host; a context that changes nothing for any other layer."""
    if not getattr(peft_layer, "use_dora", {}).get(adapter_name, False):
        return nullcontext(False)
    return speed.layer_on_device(transformer, peft_layer.get_base_layer())


def _set(holder, adapter_name: str, value: torch.Tensor, like: torch.Tensor) -> None:
    holder[adapter_name] = torch.nn.Parameter(value.to(like.device, like.dtype), requires_grad=like.requires_grad)


def _write(peft_layer, adapter_name: str, layer, strength: float, peft_scale: float, *, replace: bool) -> None:
    """Put a file layer into one peft layer whose adapter scale is `peft_scale`, so that the weight is ComfyUI's at
    `strength`. LoKr with `replace`: the peft factors take the file's shapes (full or low-rank)."""
    if layer.kind == "lora":
        peft_layer.lora_A[adapter_name].weight.copy_(layer.down)
        up = layer.up * (layer.scale * strength)
        if layer.dora_scale is not None:
            base = peft_layer.get_base_layer().weight
            up, magnitude = peft_dora_from(base, layer.down, layer.up, layer.scale, layer.dora_scale, strength)
            peft_layer.lora_magnitude_vector[adapter_name].weight.copy_(magnitude)
        peft_layer.lora_B[adapter_name].weight.copy_(up / peft_scale if peft_scale else up)
        return
    names = LOKR_KEYS if layer.kind == "lokr" else LOHA_KEYS
    tensors = layer.tensors()
    first = "lokr_w1" if "lokr_w1" in tensors else "lokr_w1_a" if layer.kind == "lokr" else "hada_w1_a"
    like = next(getattr(peft_layer, n)[adapter_name] for n in names if adapter_name in getattr(peft_layer, n))
    for name in names:
        holder = getattr(peft_layer, name)
        if name not in tensors:
            if replace and adapter_name in holder:
                del holder[adapter_name]
            continue
        value = tensors[name] * (layer.scale * strength / peft_scale if name == first and peft_scale else 1.0)
        if replace:
            _set(holder, adapter_name, value, like)
        else:
            holder[adapter_name].copy_(value)


def _fits(peft_layer, adapter_name: str, layer) -> str | None:
    """Why a file layer does not fit an existing peft layer, or None."""
    kind = peft_kind(peft_layer)
    if layer.kind != kind:
        return f"file {layer.kind}, adapter {kind}"
    if kind == "lora":
        if (layer.dora_scale is not None) != bool(peft_layer.use_dora.get(adapter_name, False)):
            return "DoRA in one of the file and the adapter only"
        if layer.rank != peft_layer.r[adapter_name]:
            return f"file rank {layer.rank}, adapter rank {peft_layer.r[adapter_name]}"
        return None
    names = LOKR_KEYS if kind == "lokr" else LOHA_KEYS
    have = {n: tuple(getattr(peft_layer, n)[adapter_name].shape) for n in names
            if adapter_name in getattr(peft_layer, n)}
    want = {n: tuple(t.shape) for n, t in layer.tensors().items()}
    return None if have == want else f"file factors {want}, adapter factors {have}"


def _zero(peft_layer, adapter_name: str) -> None:
    """No weight change from this adapter layer (it starts from zero when training continues)."""
    kind = peft_kind(peft_layer)
    if kind == "lora":
        peft_layer.lora_B[adapter_name].weight.zero_()
        if peft_layer.use_dora.get(adapter_name, False):
            base = peft_layer.get_base_layer().weight
            peft_layer.lora_magnitude_vector[adapter_name].weight.copy_(row_norm(base).reshape(-1))
        return
    for name in ("lokr_w1", "lokr_w1_a") if kind == "lokr" else ("hada_w1_a",):
        if adapter_name in getattr(peft_layer, name):
            getattr(peft_layer, name)[adapter_name].zero_()


def into_existing(transformer, weights: LoraWeights, adapter_name: str, strength: float) -> None:
    """Copy the file into an existing adapter, keeping the adapter's kind, factor shapes and scale (the file's
    scale is folded into B / the first factor); adapter layers the file lacks change nothing until trained."""
    layers = adapter_layers(transformer, adapter_name)
    outside = [n for n in weights.layers if n not in layers]
    misfit = [f"{n}: {why}" for n, lay in weights.layers.items() if n in layers
              and (why := _fits(layers[n], adapter_name, lay))]
    zero_scale = [n for n, layer in layers.items() if base_scale(layer, adapter_name) == 0]
    if outside or misfit or zero_scale:
        raise ValueError(f"the LoRA file does not fit adapter {adapter_name!r}: modules it does not target "
                         f"{outside[:4]}, mismatches {misfit[:4]}, alpha 0 on {zero_scale[:4]}; match "
                         "model.lora type/dora/rank/targets to the file")
    with torch.no_grad():
        for name, peft_layer in layers.items():
            with _dora_base_on_device(transformer, peft_layer, adapter_name):
                if name in weights.layers:
                    _write(peft_layer, adapter_name, weights.layers[name], strength,
                           base_scale(peft_layer, adapter_name), replace=False)
                else:
                    _zero(peft_layer, adapter_name)
    if len(layers) > len(weights.layers):
        log.info("adapter %r: %d of its modules are not in the file and start from zero", adapter_name,
                 len(layers) - len(weights.layers))
