"""Shared benchmark plumbing: model setup (tiny or real-size random weights), timing, table printing."""

from __future__ import annotations

import contextlib
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_dtype(device: torch.device) -> torch.dtype:
    """The real-size benchmarks' compute dtype: bf16 on CUDA; float32 elsewhere (a smoke run of the plumbing at
    toy sizes: a CPU's bf16 matmuls run 50-100x slower than its float32 ones)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def median_time(fn, device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median wall time of `fn()` over `repeats` runs after `warmup` runs, synchronizing the device."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def reserved_gib(device: torch.device) -> float | None:
    """The caching allocator's peak reserved memory (what the process takes from the GPU: the allocated peak plus
    fragmentation), GiB; None off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_reserved(device) / 2**30


def pinned_gib(device: torch.device) -> float | None:
    """Pinned host memory torch's host allocator holds now (offloaded blocks, staging buffers), GiB; None off CUDA
    or on a torch without its statistics (`torch.cuda.host_memory_stats`)."""
    if device.type != "cuda" or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) / 2**30


def gib_text(value: float | None) -> str:
    """A table cell for a GiB figure: one decimal, "-" where there is none (off CUDA)."""
    return "-" if value is None else f"{value:.1f}"


def top_kernels(ran: list[tuple[str, float]], top: int = 5) -> str:
    """The first `top` kernels of `speed.kernel_shares` (name, share of the device time) as one table cell."""
    return "; ".join(f"{name[:50]} {100 * share:.0f}%" for name, share in ran[:top]) or "-"


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Create modules directly in `dtype` (a 20 B-parameter model does not fit in fp32 first)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def real_transformer(device: torch.device, dtype: torch.dtype, num_layers: int | None = None):
    """The real Qwen-Image transformer config with random weights, built directly on `device` in `dtype`."""
    from qwen_edit_core.families import DEFAULT
    config = DEFAULT.stage("tiny").transformer_config("real", num_layers=num_layers)
    with default_dtype(dtype), torch.device(device):
        model = DEFAULT.class_of("transformer")(**config)
    return model.eval().requires_grad_(False)


def bench_components(real_size: bool, device: torch.device, dtype: torch.dtype, workdir: Path | None = None,
                     num_layers: int | None = None):
    """Components for a benchmark: the tiny model, or real-width encoders with a real-size random transformer
    (`num_layers` blocks; default the real 60)."""
    from qwen_edit_core.model.components import load_components
    from qwen_edit_core.model.devices import DevicePlan
    from qwen_edit_core.model.tiny import build_tiny

    workdir = Path(workdir or tempfile.mkdtemp(prefix="qwen-edit-bench-"))
    model_dir = build_tiny(workdir / ("real-width" if real_size else "tiny"), size="real-width" if real_size
                           else "tiny")
    plan = DevicePlan.from_mapping({"text_encoder": str(device), "vae": str(device), "transformer": str(device)},
                                   dtype=dtype)
    which = ("vae", "text_encoder") if real_size else ("transformer", "vae", "text_encoder")
    comps = load_components(model_dir, plan, which=which)
    if real_size:
        torch.manual_seed(0)
        comps.transformer = real_transformer(device, dtype, num_layers=num_layers)
    return comps


def print_table(title: str, header: list[str], rows: list[list]) -> str:
    """Format and log a plain-text table; returns it (benchmarks also write it to BENCHMARKS.md by hand)."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = [title, " | ".join(h.ljust(w) for h, w in zip(header, widths)),
             "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in rows]
    text = "\n".join(lines)
    log.info("\n%s", text)
    return text


def matmul_peaks(device: torch.device, n: int = 8192, repeats: int = 20) -> dict[str, float]:
    """Measured TFLOP/s of an n^3 bf16 matmul and of an fp8 e4m3 `torch._scaled_mm` (rowwise scales), on random
    data: the ceilings MFU is reported against."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    sa = torch.ones(n, 1, device=device)
    sb = torch.ones(1, n, device=device)
    out = {}
    for name, fn in (("bf16", lambda: a @ b), ("fp8", lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb,
                                                                                 out_dtype=torch.bfloat16))):
        t = median_time(fn, device, repeats, warmup=3)
        out[name] = 2 * n**3 / t / 1e12
    return out


def h2d_gbps(device: torch.device, gib: float = 1.0) -> float:
    """Pinned host-to-device copy bandwidth (GB/s): what block offloading streams at."""
    host = torch.empty(int(gib * 2**30), dtype=torch.uint8).pin_memory()
    t = median_time(lambda: host.to(device, non_blocking=True), device, 5)
    return host.numel() / t / 1e9
