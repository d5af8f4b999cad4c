"""Which attention kernel runs, and which one ran.

`train.attention` / `predict.attention` name a kernel; `attention_kernel(name)` is the context (around the
forward and the backward) under which it runs first:

- "auto": on a GPU with a row in `FASTEST_FIRST` (by CUDA compute capability), the SDPA kernels in that row's
  order, the first one this torch offers going first (`auto_kernel`); elsewhere torch's own SDPA order, unchanged.
  Only SDPA kernels: each falls back to the others where it cannot run a call, which flash3 cannot.
- "cudnn", "flash", "efficient", "math": that SDPA backend first, the others after it as fallbacks (a call the
  kernel cannot run, such as a mask flash rejects, or any call on the CPU, falls through).
- "flash3": FlashAttention-3 (Hopper) through diffusers' attention dispatch (its `_flash_3` backend), where the
  `flash_attn_interface` package is importable; refused with what to install otherwise. It takes no mask: batches
  of different lengths run variable-length attention over their valid tokens (adapters.multires).

`offered_kernels(device)` lists what this torch and device offer; `kernels_ran(fn)` the attention kernels a
call launched (profiler kernel names), which the benchmarks print for every row.
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch

#: `train.attention` / `predict.attention` values (config.AttentionKernel mirrors it)
ATTENTION_KERNELS = ("auto", "cudnn", "flash", "efficient", "math", "flash3")
#: the values the ComfyUI speed node offers (its inputs never change: config values beyond these are CLI/YAML's)
SDPA_KERNELS = ("auto", "cudnn", "flash", "efficient", "math")
#: kernels reached through diffusers' attention dispatch: name -> (diffusers backend, the module it imports)
DIFFUSERS_KERNELS = {"flash3": ("_flash_3", "flash_attn_interface")}
#: substrings of the profiler names of attention kernels and ops (CUDA kernels of flash, cuDNN, xformers-style
#: fmha; the CPU's aten ops), lower case
ATTENTION_NAME_PARTS = ("flash", "fmha", "cudnn", "attention", "attn", "sdpa", "mha")


#: The SDPA kernels "auto" tries, fastest first, by CUDA compute capability, with the source of the order. A
#: row's order is replaced by what the runbook measures on that GPU (`qwen-edit bench attention`, in
#: bench/device_run.sh: each offered kernel timed at a real prompt's length, the row to put here printed).
FASTEST_FIRST: dict[tuple[int, int], tuple[tuple[str, ...], str]] = {
    (9, 0): (("cudnn", "flash", "efficient"),
             "pytorch.org/blog/pytorch2-5: cuDNN's fused attention up to 75% faster than FlashAttention-2 on H100; "
             "not yet measured by the runbook"),
}


def auto_kernel(capability: tuple[int, int] | None, offered: tuple[str, ...]) -> str:
    """The kernel "auto" puts first on a GPU of `capability` ((major, minor); None: no CUDA device) offering the
    kernels `offered`: the first offered one of its `FASTEST_FIRST` row; "auto" (torch's own SDPA order) where
    the table has no row for it or offers none of the row's kernels."""
    row = FASTEST_FIRST.get(tuple(capability)) if capability is not None else None
    if row is None:
        return "auto"
    return next((name for name in row[0] if name in offered), "auto")


def check_attention_kernel(name: str) -> None:
    if name not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel {name!r} is not accepted; accepted: {', '.join(ATTENTION_KERNELS)}")


def _sdpa_backends() -> dict:
    from torch.nn.attention import SDPBackend
    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def offered_kernels(device: torch.device | str) -> tuple[str, ...]:
    """The kernels this torch and `device` offer, by name (without running anything): on the CPU "math" (torch's
    CPU SDPA); on CUDA the SDPA backends this build has, and "flash3" on Hopper where its package imports."""
    device = torch.device(device)
    if device.type != "cuda":
        return ("math",)
    offered = ["efficient", "math"]
    if torch.backends.cuda.is_flash_attention_available():
        offered.insert(0, "flash")
    if torch.backends.cudnn.is_available():
        offered.insert(0, "cudnn")
    major, _ = torch.cuda.get_device_capability(device)
    if major == 9 and importlib.util.find_spec(DIFFUSERS_KERNELS["flash3"][1]) is not None:
        offered.insert(0, "flash3")
    return tuple(offered)


def attention_kernel(name: str, device: torch.device | str | None = None):
    """A context manager under which attention prefers kernel `name` (see the module doc), falling back to the
    others when it cannot run the call. torch's SDPA backend flags (`torch.nn.attention.sdpa_kernel`) or
    diffusers' active attention backend (`attention_backend`) are set for the block and restored on exit.
    "auto" picks by `device`'s compute capability (`auto_kernel`; torch's order without a device).

    Wrap the forward and the backward pass of a step: a checkpointed block's recompute runs in the backward.
    """
    from torch.nn.attention import sdpa_kernel
    check_attention_kernel(name)
    if name == "auto" and device is not None and torch.device(device).type == "cuda":
        name = auto_kernel(torch.cuda.get_device_capability(device), offered_kernels(device))
    if name == "auto":
        return contextlib.nullcontext()
    if name in DIFFUSERS_KERNELS:
        backend, module = DIFFUSERS_KERNELS[name]
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"attention kernel {name!r} needs the {module!r} package (FlashAttention-3, built from "
                             "github.com/Dao-AILab/flash-attention hopper/ for a Hopper GPU); use 'cudnn' or 'auto'")
        from diffusers.models.attention_dispatch import attention_backend
        return attention_backend(backend)
    order = _sdpa_backends()
    first = order.pop(name)
    return sdpa_kernel([first, *order.values()], set_priority=True)


def is_attention_name(name: str) -> bool:
    """Whether a profiler event name is an attention kernel or op (ATTENTION_NAME_PARTS)."""
    lowered = name.lower()
    return any(part in lowered for part in ATTENTION_NAME_PARTS)


def kernels_ran(fn, device: torch.device | str) -> list[tuple[str, float]]:
    """Run `fn()` once under torch's profiler; the attention kernels it launched (CUDA kernels on a GPU, aten ops
    on the CPU) with their share of the profiled device time, largest first. For benchmarks: a profiled call is
    slower than an unprofiled one."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize(device)
    return [(name, share) for name, share in kernel_shares(prof, cuda) if is_attention_name(name)]


def kernel_shares(prof, cuda: bool) -> list[tuple[str, float]]:
    """Every kernel (CUDA kernels when `cuda`, else the CPU's aten ops) a finished `torch.profiler.profile`
    recorded, with its share of the profiled device time, largest first."""
    timed = [(e.key, (e.self_device_time_total if cuda else e.self_cpu_time_total)) for e in prof.key_averages()]
    total = sum(t for _, t in timed) or 1.0
    return sorted(((k, t / total) for k, t in timed if t > 0), key=lambda kt: -kt[1])


def kernels_text(ran: list[tuple[str, float]], top: int = 2) -> str:
    """`kernels_ran`'s first `top` names with their shares, for a table cell ("-" when none ran)."""
    if not ran:
        return "-"
    return "; ".join(f"{name[:60]} {100 * share:.0f}%" for name, share in ran[:top])
