"""Context-parallel sampling: the transformer's tokens split across the processes of a `torchrun` group.

Each process holds the whole transformer and 1/N of the image and text tokens; attention exchanges them with
diffusers' own context-parallel machinery (the `_cp_plan` that diffusers 0.42 declares for
`QwenImageTransformer2DModel`, Ulysses all-to-all or ring attention over the native SDPA backend). It helps at any
CFG, CFG 1 (few-step Lightning edits) included, where the two-device CFG split has nothing to split.

Why not `ModelMixin.enable_parallelism`: diffusers 0.42 picks the device as `rank % torch.accelerator.
device_count()`, which divides by zero on a CPU-only machine, so the same code could not run in CI. We build the
same `ParallelConfig` (with the transformer's own device), set it on the attention processors and apply the
model's `_cp_plan` with diffusers' `apply_context_parallel`, which is what `enable_parallelism` does.

Our multi-resolution attention processor (training, batched sampling of mixed sizes) does not take part in
context parallelism: a transformer carrying it is refused with the reason.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

CP_MODES = ("ulysses", "ring")


def _check_group(degree: int) -> tuple[int, int]:
    """(rank, world size) of the running process group, which must have exactly `degree` processes."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"context parallel over {degree} processes needs a process group: run under "
                         f"`torchrun --nproc_per_node {degree} -m qwen_edit_core.cli sample ...`")
    world = dist.get_world_size()
    if world != degree:
        raise ValueError(f"--context-parallel {degree} but the process group has {world} processes: start "
                         f"torchrun with --nproc_per_node {degree}")
    return dist.get_rank(), world


def init_process_group(degree: int, device: torch.device) -> None:
    """Join the `torchrun` group (gloo for CPU tensors, NCCL for CUDA ones); refuses a run started without
    enough processes."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != degree:
        raise ValueError(f"--context-parallel {degree} needs {degree} processes, this run has {world}: start it "
                         f"with `torchrun --nproc_per_node {degree} -m qwen_edit_core.cli sample ...`")
    if not dist.is_initialized():
        # gloo for the CPU tensors in every case: diffusers' uneven ("anything") splits exchange the per-process
        # token counts as CPU tensors when the group has a CPU backend (diffusers 0.42 `gather_size_by_comm`).
        backend = "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "cpu:gloo"
        if not dist.is_gloo_available():
            raise ValueError("context parallel needs torch.distributed's gloo backend (for the token counts), "
                             "which this torch build lacks")
        dist.init_process_group(backend)


def process_device(device: str) -> str:
    """The transformer's device for this process: under torchrun on GPUs, the GPU of LOCAL_RANK."""
    if device.startswith("cuda") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


def enable(transformer: torch.nn.Module, degree: int, mode: str = "ulysses") -> None:
    """Split `transformer`'s tokens over the `degree` processes of the running group (in place, once).

    `mode`: "ulysses" (all-to-all over the attention heads: the degree must divide the head count; any device)
    or "ring" (keys and values passed around the ring, with cuDNN attention: CUDA only); both accept token counts
    that do not divide evenly."""
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    if mode not in CP_MODES:
        raise ValueError(f"context-parallel mode {mode!r} is not accepted; accepted: {', '.join(CP_MODES)}")
    if getattr(transformer, "_parallel_config", None) is not None:
        return
    processors = {type(p).__name__ for p in transformer.attn_processors.values()}
    if any(not hasattr(p, "_parallel_config") for p in transformer.attn_processors.values()):
        raise ValueError(f"context parallel needs diffusers' own attention processor; this transformer runs "
                         f"{', '.join(sorted(processors))} (the multi-resolution adapter of training and batched "
                         "sampling), which cannot exchange tokens between processes: sample from a fresh load")
    if transformer.config.num_attention_heads % degree and mode == "ulysses":
        raise ValueError(f"ulysses context parallel splits the {transformer.config.num_attention_heads} attention "
                         f"heads over {degree} processes: use a degree that divides it, or --cp-mode ring")
    device = next(transformer.parameters()).device
    if mode == "ring":
        _ring_backend(transformer, device)
    init_process_group(degree, device)  # a no-op when the caller joined the group already
    rank, world = _check_group(degree)
    # "anything": token counts need not divide by the degree (prompts have any length).
    cp = ContextParallelConfig(ulysses_degree=degree, ulysses_anything=True) if mode == "ulysses" else \
        ContextParallelConfig(ring_degree=degree, ring_anything=True)
    mesh = init_device_mesh(device.type, cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names)
    config = ParallelConfig(context_parallel_config=cp)
    config.setup(rank, world, device, mesh=mesh)
    transformer._parallel_config = config
    for processor in transformer.attn_processors.values():
        processor._parallel_config = config
    apply_context_parallel(transformer, cp, transformer._cp_plan)
    log.info("context parallel: %s over %d processes (this is rank %d)", mode, degree, rank)


def _ring_backend(transformer: torch.nn.Module, device: torch.device) -> None:
    """Ring attention merges partial results with their log-sum-exp, which PyTorch's SDPA does not return
    (diffusers 0.42: "Native attention does not support return_lse=True"); cuDNN's attention through diffusers'
    `_native_cudnn` backend does, on CUDA only."""
    if device.type != "cuda":
        raise ValueError("ring context parallel needs an attention kernel that returns the log-sum-exp (cuDNN or "
                         f"flash attention, CUDA only); on {device.type} use --cp-mode ulysses")
    transformer.set_attention_backend("_native_cudnn")
