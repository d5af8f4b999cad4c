"""The real-size transformer without memory: the product's model, LoRA and inputs as fake tensors.

Everything runs under torch's `FakeTensorMode`: tensors carry shapes, dtypes and devices but no data, so a
20 B-parameter step runs on a laptop CPU in about a minute and `MemTracker` counts every byte it would hold.

Why the fake `cpu` device stands for the GPU (checked with torch 2.14): fake `cuda` tensors run the forward but
the backward fails without a CUDA driver (`hasPrimaryContext expects a valid device index`), and fake `meta`
tensors cannot run under autocast (`unsupported autocast device_type 'meta'`), while the training step needs
bf16 autocast to hold what a GPU holds (the fp32 LoRA would otherwise save fp32 copies of its inputs). Fake
`cpu` tensors run the forward, the backward and `torch.autocast("cpu")` exactly as a GPU step is traced, and
the product's levers treat the device as a plain one (the offloader copies synchronously, with no side
stream: the same bytes). Host copies made by the offloader are therefore on the same fake device: they are
created before the step is tracked and counted from the offloader itself (bench/memory.py `pinned_host_bytes`).

peft cannot inject adapters under FakeTensorMode (`_apply(): Couldn't swap Linear.weight`), so the model is
built on the `meta` device, the LoRA is injected there by the product's own `adapters.lora.inject_lora`, and
only then is every parameter and buffer replaced by a fake tensor of the same shape and dtype.
"""

from __future__ import annotations

from copy import deepcopy

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from qwen_edit_core.families import variants
from qwen_edit_core.model import prompt_length

#: the fake device that stands for the GPU (see the module docstring)
STAND_IN = torch.device("cpu")
#: a long caption's own tokens, beside the vision tokens the template adds (model/prompt_length.py)
CAPTION_TOKENS = prompt_length.CAPTION_TOKENS


class Tracker(MemTracker):
    """`MemTracker` for a frozen base with a LoRA, fast enough for 60 blocks.

    Two changes to the stock tracker, both measured here: it registers a gradient hook on every parameter
    of a module it enters, which raises for frozen ones (`cannot register a hook on a tensor that doesn't
    require gradient`), so hooks go on trainable parameters only; and after every operator it updates the
    peak of every module seen so far, which made a 60-block step quadratic (6 blocks took 10x the time of
    2), so only the per-device peak (all this bench reports) is kept, which also lets the root module run
    twice in one tracked region (sampling's cond and uncond forwards).
    """

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        out = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            for param in module.parameters():
                if param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(self._grad_seen),
                        param.register_post_accumulate_grad_hook(lambda p: self._grad_seen(p.grad)))
        return out

    def keep_off_device(self, tensors) -> None:
        """Count nothing stored in `tensors`' storages: host memory (a host-kept cache's region) that the stand-in
        device, being the CPU, cannot tell apart; copying into it would otherwise register it as the device's."""
        from torch.distributed._tools.common_utils import get_untyped_storages
        self._host_storages = getattr(self, "_host_storages", [])
        self._host_storages += [st for t in tensors for st in get_untyped_storages(t)]

    def _on_host(self, t: torch.Tensor) -> bool:
        from torch.distributed._tools.common_utils import get_untyped_storages
        host = getattr(self, "_host_storages", ())
        return bool(host) and any(st is h for st in get_untyped_storages(t) for h in host)

    def _update_and_maybe_create_winfos(self, t, reftype, update_existing: bool = False):
        return set() if self._on_host(t) else super()._update_and_maybe_create_winfos(t, reftype, update_existing)

    def _track(self, reftype, t: torch.Tensor) -> None:  # every operator's outputs
        if not self._on_host(t):
            super()._track(reftype, t)

    def _grad_seen(self, grad: torch.Tensor) -> None:
        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

    def _pre_fw_hook(self, module, inputs) -> None:
        # A second top-level forward in one tracked region (cond then uncond) is refused by the stock tracker,
        # whose per-module statistics assume one iteration; only the per-device peak is kept here.
        name = self._mod_tracker.get_known_fqn(module)
        if module in self.memory_tracking and not self._mod_tracker.is_bw and \
                set(self._mod_tracker.parents) - {name} == {"Global"}:
            self.reset_mod_stats()
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = deepcopy(snap)

    def peak_bytes(self, device: torch.device = STAND_IN) -> dict[str, int]:
        """The peak snapshot of `device` by category (parameter, buffer, gradient, activation, temp,
        optimizer state, other) plus "Total", in bytes."""
        snap = self._peak_mem_snap.get(torch.device(device), {})
        return {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}


class _NoModules:
    """Stands for FlopCounterMode's module tracker: every FLOP is counted under "Global" only."""

    parents = ("Global",)

    def __enter__(self):
        return self

    def __exit__(self, *args) -> None:
        return None


def _cpu_attention_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_attention_backward_flops(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


_cpu_attention_flops._get_raw = _cpu_attention_backward_flops._get_raw = True  # called with tensors


class GlobalFlops(FlopCounterMode):
    """`FlopCounterMode` counting the whole step only. Its per-module tracker registers gradient hooks on
    every module's outputs, which keeps a checkpointed block's activations alive (measured here: with it, a
    4-block step held 1.11 GiB of activations, without it 0.45 GiB, as without checkpointing), so it would
    change the memory it runs beside. The stand-in device's fused attention (`..._for_cpu`) is counted with
    torch's own formulas for the GPU kernels (torch's table lacks the CPU names)."""

    def __init__(self):
        aten = torch.ops.aten
        super().__init__(display=False, custom_mapping={
            aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flops})
        self.mod_tracker = _NoModules()


def _simulated(variant: str):
    """The bench stage module of `variant`'s family (families/<family>/fake_model.py): its fake mode, real
    configuration, prompt length, cache entry and fake batch."""
    return variants.get(variant).family.stage("fake_model")


def fake_mode(variant: str = variants.DEFAULT) -> FakeTensorMode:
    """The fake mode every simulated tensor of `variant` lives in; real CPU inputs are taken as constants (a
    family may run operators on its real token layout for real: its `fake_mode`)."""
    return _simulated(variant).fake_mode()


def transformer_config(variant: str, num_layers: int | None = None) -> dict:
    """The real transformer configuration of `variant` (its family's `real_config`)."""
    return _simulated(variant).real_config(variant, num_layers)


def fake_transformer(variant: str, mode: FakeTensorMode, *, lora=None, num_layers: int | None = None,
                     dtype: torch.dtype = torch.bfloat16):
    """The real-size transformer of `variant` in `dtype` with fake weights on `STAND_IN` (what today's loaders
    leave on the device: the whole model, before any lever), a LoRA injected first when `lora` (a
    `adapters.lora.LoraSpec`) is given."""
    from qwen_edit_core.adapters import lora as lora_mod
    cls = variants.get(variant).family.class_of("transformer")
    with torch.device("meta"):
        model = cls(**transformer_config(variant, num_layers))
    model = model.to(dtype).eval().requires_grad_(False)
    if lora is not None:
        lora_mod.inject_lora(model, lora)
    with mode:
        for module in model.modules():
            _fake_tensor_attributes(module)
            for name, param in list(module._parameters.items()):
                if param is not None:
                    module._parameters[name] = torch.nn.Parameter(torch.empty_like(param, device=STAND_IN),
                                                                   requires_grad=param.requires_grad)
            for name, buf in list(module._buffers.items()):
                if buf is not None:
                    module._buffers[name] = torch.empty_like(buf, device=STAND_IN)
    return model


def _fake_tensor_attributes(module) -> None:
    """Tensors a module keeps as plain attributes (2.1's rotary tables: a list per axis) built on `meta`, as fake
    `STAND_IN` tensors (call under the fake mode)."""
    for name, value in list(vars(module).items()):
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            setattr(module, name, torch.empty_like(value, device=STAND_IN))
        elif isinstance(value, list) and value and all(isinstance(v, torch.Tensor) and v.device.type == "meta"
                                                       for v in value):
            setattr(module, name, [torch.empty_like(v, device=STAND_IN) for v in value])


def text_tokens(variant: str, side: int, controls: int) -> int:
    """Prompt tokens of one sample with `controls` `side` x `side` control images, as the planner counts them
    (its family's `prompt_tokens`; model/prompt_length.py for the 2025 family)."""
    return _simulated(variant).prompt_tokens(variant, side, controls)


def cache_item(variant: str, side: int, controls: int) -> dict:
    """A real (small: latents and embeddings, tens of MB) cache entry of one `side` x `side` pair with
    `controls` control images of the same size, in the layout `train.batch.collate` reads (its family's
    `fake_entry`)."""
    return _simulated(variant).fake_entry(variant, side, controls)


def fake_batch(batch, mode: FakeTensorMode):
    """A collated batch with its latents as fake device tensors the tracker counts (its family's `fake_batch`)."""
    return batch.family.stage("fake_model").fake_batch(batch, mode)


def default_controls(variant: str) -> int:
    """Control images of the variant's usual edit (its family's `default_controls`)."""
    return _simulated(variant).default_controls(variant)


def simulates_sampling(variant: str) -> bool:
    """Whether `bench memory` simulates sampling steps for `variant` (its family's `SAMPLING_SIMULATED`)."""
    return _simulated(variant).SAMPLING_SIMULATED
