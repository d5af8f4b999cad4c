"""Plan first, then load: the transformer streamed block by block straight into its planned form and place.

Loading the whole model on the device and applying fp8 or offloading afterwards needs the whole bf16 model (or a
whole scaled-fp8 file) on the device first (docs/MODEL.md, "The real model's sizes"), so no plan below that could
ever be reached. Here the plan (`speed.WeightPlan`: device, dtype, fp8, offloaded blocks) is made before any
weight is read, the model is built on the meta device (shapes only), and each module's tensors are read from the
files (model/weight_source.py), converted and placed where the plan keeps them:
- a module of a resident block (and the embedders, norms and output projection) goes to the device as stored
  and is converted there (cast to the compute dtype; fp8 where planned, with `speed.quantize_rows`, the same
  function `speed.quantize_fp8` uses, so the weights equal those of the load-then-quantize path);
- a module of an offloaded block is converted on the host and stays there, copied into the plan's one pinned
  region when the device is CUDA (`speed.HostRegion`, sized from the file's header: exactly the offloaded blocks'
  bytes, where one `pin_memory()` per tensor was rounded up to a power of two each); the `speed.BlockOffloader`
  made at the end takes those host tensors as they are (no device copy ever exists).
So the device holds, at any moment, the resident weights placed so far plus one module's tensors being
converted (at most about 0.4 GiB for the real model's largest linear: bf16 in, fp32 temporaries, fp8 out).

Both model families load here (the 2025 Qwen-Image transformer and Qwen-Image-2.1's): the source names its
family (families/family.py), which gives the class built on the meta device, the attribute holding the blocks,
and the layout mapping a single file's keys onto that class's (2.1's ComfyUI files fuse the MLP's gate and up
projections; `single_file21.split_fused` splits them, scales included, before any conversion).

Under FSDP2 (several processes sharding the base) each process streams the transformer into host memory
(`train.sharding.host_plan`: plan.device is the host); sharding then moves it to the device one block at a
time, keeping each process's share (train/sharding.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from qwen_edit_core import speed
from qwen_edit_core.model import single_file, weight_source

log = logging.getLogger(__name__)

HOST = torch.device("cpu")


def build_skeleton(source, fp8: bool) -> torch.nn.Module:
    """The transformer of `source`'s config on the meta device (no memory), frozen; its block linears
    `speed.Fp8Linear` when `fp8`."""
    from accelerate import init_empty_weights
    transformer_class = source.family.class_of("transformer")
    with torch.inference_mode(False), init_empty_weights():  # ComfyUI runs nodes under inference mode
        model = transformer_class.from_config(source.config()).requires_grad_(False)
        if fp8:
            speed.quantize_fp8(model)
    return model


def fp8_modules(model: torch.nn.Module) -> set[str]:
    """Paths of the model's `speed.Fp8Linear` layers."""
    return {name for name, module in model.named_modules() if isinstance(module, speed.Fp8Linear)}


def planned_state(state: dict[str, torch.Tensor], fp8: set[str]) -> dict[str, torch.Tensor]:
    """Converted entries with the weights of `fp8` modules quantized per output channel where they are not in
    fp8 yet (`weight` -> `weight_fp8` + `weight_scale`, as `speed.Fp8Linear.__init__` does); bias and the
    rest as they are."""
    out = {}
    for key, value in state.items():
        module, _, leaf = key.rpartition(".")
        if module in fp8 and leaf == "weight":
            out[f"{module}.weight_fp8"], out[f"{module}.weight_scale"] = speed.quantize_rows(value)
        else:
            out[key] = value
    return out


def _home(module: str, offloaded: set[str], device: torch.device) -> torch.device:
    """Where a module's weights live: the host for a module inside an offloaded block ("blocks.i"), else the
    device."""
    parts = module.split(".")
    return HOST if len(parts) > 1 and ".".join(parts[:2]) in offloaded else device


def _assign(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put each converted tensor in place of its meta tensor (`load_state_dict(assign=True)` per module)."""
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        module, _, leaf = key.rpartition(".")
        by_module.setdefault(module, {})[leaf] = value
    for module, tensors in by_module.items():
        model.get_submodule(module).load_state_dict(tensors, strict=False, assign=True)


def host_region(converted: dict[str, torch.Tensor], offloaded: set[str],
                plan: speed.WeightPlan) -> tuple[speed.HostRegion | None, dict[str, int]]:
    """The pinned host region the offloaded blocks' converted tensors are streamed into (one per plan, exactly
    their bytes: speed.host_memory) and each key's place in it, from the converted header (`_check`); None where
    nothing is pinned (no offloaded block, or a device that copies synchronously)."""
    device = torch.device(plan.device)
    keys = [k for k in converted if _home(k.rpartition(".")[0], offloaded, device) == HOST]
    if not keys or not plan.pin:
        return None, {}
    region = speed.HostRegion([(converted[k].shape, converted[k].dtype) for k in keys], pin=True)
    return region, {k: i for i, k in enumerate(keys)}


def _pinned(state: dict[str, torch.Tensor], region: speed.HostRegion | None, places: dict[str, int]):
    """A host module's converted tensors copied into their places in the plan's pinned region."""
    missing = sorted(set(state) - set(places))
    if region is None or missing:
        raise ValueError(f"planned load: {missing or sorted(state)} had no place in the pinned host region planned "
                         "from the file's header (the header and the streamed tensors disagree)")
    return {k: region.put(places[k], v) for k, v in state.items()}


def stream_weights(model: torch.nn.Module, source, plan: speed.WeightPlan, keep: bool = False,
                   converted: dict[str, torch.Tensor] | None = None) -> None:
    """Fill `model` (from `build_skeleton`) from `source` one module at a time, each tensor read, converted and
    placed where `plan` keeps it (module doc); `keep`: the source's fp8 weights stay in fp8; `converted`: the
    converted header (`_check`; read here when not given), which sizes the pinned host region."""
    device = torch.device(plan.device)
    offloaded = {f"{source.family.blocks}.{i}" for i in plan.offloaded}
    fp8 = fp8_modules(model)
    if converted is None and plan.offloaded and plan.pin:
        converted = planned_state(source.convert(source.header(), fp8, plan.dtype, keep), fp8)
    region, places = host_region(converted, offloaded, plan) if converted is not None else (None, {})
    for tensors in source.modules():
        home = _home(next(iter(tensors)).rpartition(".")[0], offloaded, device)
        state = planned_state(source.convert({k: v.to(home) for k, v in tensors.items()}, fp8, plan.dtype, keep), fp8)
        if home == HOST and plan.pin:
            state = _pinned(state, region, places)
        del tensors
        _assign(model, state)
    for name, buffer in model.named_buffers():  # buffers the skeleton made for real (on the host)
        owner, _, leaf = name.rpartition(".")
        if buffer.device != device and _home(owner, offloaded, device) != HOST:
            model.get_submodule(owner)._buffers[leaf] = buffer.to(device)


def _check(model: torch.nn.Module, source, plan: speed.WeightPlan, keep: bool) -> dict[str, torch.Tensor]:
    """Refuse, before any weight is read, a source whose tensors do not match the architecture it declares;
    returns the converted header (meta tensors)."""
    fp8 = fp8_modules(model)
    converted = planned_state(source.convert(source.header(), fp8, plan.dtype, keep), fp8)
    single_file.check_state_dict(converted, model.state_dict(),
                                 f"{source.name}: does not match the architecture of its config")
    return converted


def check_card(converted: dict[str, torch.Tensor], plan: speed.WeightPlan, blocks: str, name: str) -> None:
    """Refuse, before any weight is read, a plan whose device weights (every tensor outside the offloaded blocks,
    in its planned form, from the converted header) exceed the CUDA card's whole memory: no unloading of other
    models can make room, and the load would fail part way with an out-of-memory error."""
    device = torch.device(plan.device)
    if device.type != "cuda":
        return
    offloaded = {f"{blocks}.{i}" for i in plan.offloaded}
    needed = sum(t.numel() * t.element_size() for k, t in converted.items()
                 if _home(k.rpartition(".")[0], offloaded, device) != HOST)
    total = torch.cuda.mem_get_info(device)[1]
    if needed > total:
        form = "fp8 block linears" if plan.fp8 else str(plan.dtype).removeprefix("torch.")
        raise ValueError(f"{name}: the transformer's weights take {needed / 2**30:.1f} GiB on {device} ({form}"
                         f"{f', {len(plan.offloaded)} blocks in host memory' if plan.offloaded else ''}), more than "
                         f"its {total / 2**30:.1f} GiB: read it into fp8 (transformer_fp8 on the loader, "
                         "predict.fp8) or from a scaled-fp8 file, or load it on a larger device")


def load_transformer_planned(source, plan: speed.WeightPlan, *,
                             skeleton: torch.nn.Module | None = None) -> torch.nn.Module:
    """The frozen transformer of `source`'s family (model/weight_source.py: the family's
    `transformer_class`) from its weights, in the form and place `plan`
    says: built on the meta device, then streamed module by module onto `plan.device` (resident blocks) or the
    host (offloaded blocks, handed to a `speed.BlockOffloader`), fp8 where planned. The model carries `plan`
    (`speed.loaded_plan`), so `speed.configure_training` applies it without planning again.

    Runs the same under torch's FakeTensorMode with a `ShapeOnlySource` and `plan.device` "meta" (a memory
    simulation of the real-size load without weights). `skeleton`: the model to fill, from `build_skeleton(source,
    fp8=plan.fp8 or source.keeps_fp8(plan.device))` (default: built here). accelerate's `init_empty_weights`
    creates each parameter on the host and moves it to the meta device, so a count that lets "meta" stand in
    for the GPU builds the skeleton before it starts counting."""
    device = torch.device(plan.device)
    with torch.inference_mode(False):  # ComfyUI calls loaders under inference mode; a LoRA must train on these
        keep = source.keeps_fp8(device)
        model = skeleton if skeleton is not None else build_skeleton(source, fp8=plan.fp8 or keep)
        converted = _check(model, source, plan, keep)
        check_card(converted, plan, source.family.blocks, source.name)
        stream_weights(model, source, plan, keep, converted)
        if plan.offloaded:
            blocks = getattr(model, source.family.blocks)
            model._qwen_edit_offloader = speed.BlockOffloader(blocks, plan.offloaded, device)
        model._qwen_edit_plan = plan
        log.info("transformer from %s: %.2f GiB on %s%s%s", source.name, speed.resident_bytes(model, device) / 2**30,
                 device, ", block linears in fp8" if speed.has_fp8(model) else "",
                 f", {len(plan.offloaded)} blocks in host memory" if plan.offloaded else "")
        return model.eval().requires_grad_(False)


def load_transformer_file(path, *, device: torch.device, dtype: torch.dtype, fp8: str = "auto"):
    """A frozen transformer of the file's family (its `transformer_class`, read from
    its keys) from one safetensors file, on `device` in `dtype`; a scaled-fp8 file's block linears stay in
    fp8 or are upcast by `fp8` ("auto", "keep", "upcast"; see the module doc).

    The planned loader with a plan of `device` and `dtype` and no lever: the architecture comes from the file's
    header, then one module at a time is read, converted and moved to `device`, so host memory stays under the
    file's size plus one module's tensors whatever `dtype` and `device` are."""
    source = weight_source.SingleFileSource(Path(path), fp8)
    model = load_transformer_planned(source, speed.WeightPlan(device=torch.device(device), dtype=dtype))
    raw = source.stored()
    if any(v.dtype in single_file._FP8 for v in raw.values()):
        stored = sum(v.numel() for k, v in raw.items() if not k.endswith(single_file._SCALE_SUFFIXES))
        upcast = stored * dtype.itemsize
        kept = "kept in fp8 (fp8 matmuls)" if speed.has_fp8(model) else f"upcast to {dtype}"
        log.info("%s: scaled fp8 %s: weights take %.2f GiB on %s (%.2f GiB upcast to %s)", path, kept,
                 single_file._bytes(model) / 2**30, device, upcast / 2**30, dtype)
    return model
