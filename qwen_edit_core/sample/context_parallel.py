"""Context-parallel sampling: the transformer's tokens split across the processes of a `torchrun` group.

Each process holds the whole transformer and 1/N of the image and text tokens; attention exchanges them with
diffusers' own context-parallel machinery (the `_cp_plan` that diffusers 0.42 declares for
the 2025 family's transformer class, Ulysses all-to-all or ring attention over the native SDPA backend). It helps at any
CFG, CFG 1 (few-step Lightning edits) included, where the two-device CFG split has nothing to split.

Why not `ModelMixin.enable_parallelism`: diffusers 0.42 picks the device as `rank % torch.accelerator.
device_count()`, which divides by zero on a CPU-only machine, so the same code could not run in CI. We build the
same `ParallelConfig` (with the transformer's own device), set it on the attention processors and apply the
model's `_cp_plan` with diffusers' `apply_context_parallel`, which is what `enable_parallelism` does.

With true CFG and `cfg_mode: split` over 2N processes, the first N run the cond branch and the other N the
uncond one, each half splitting its tokens N ways; after each step's forward every process swaps its prediction
with its twin in the other half (one all-gather over a group of two, `CfgSplit`), so both halves work at once.

Our multi-resolution attention processor (training, batched sampling of mixed sizes) does not take part in
context parallelism: a transformer carrying it is refused with the reason.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

CP_MODES = ("ulysses", "ring")
#: the backend a process group needs for each device's tensors (all-to-all, all-gather)
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


@dataclass(frozen=True)
class CfgSplit:
    """This process's CFG branch under context parallelism with `cfg_mode: split` (cond on the first half of the
    ranks, uncond on the second), and the group of two (this rank and its twin in the other half, cond first)
    that swaps the branches' predictions once per step."""

    uncond: bool
    group: object  # torch.distributed.ProcessGroup

    def exchange(self, prediction: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cond, uncond) predictions from this process's own and its twin's."""
        import torch.distributed as dist

        both = [torch.empty_like(prediction) for _ in range(2)]
        dist.all_gather(both, prediction.contiguous(), group=self.group)
        return both[0], both[1]


def processes_needed(degree: int, cfg_split: bool = False) -> int:
    """The processes a run needs: `degree` per CFG branch run at once (two with cfg_mode split)."""
    return degree * (2 if cfg_split else 1)


def _launch_hint(degree: int, cfg_split: bool) -> str:
    n = processes_needed(degree, cfg_split)
    how = f" ({degree} for cond, {degree} for uncond with --cfg-mode split)" if cfg_split else ""
    return f"{n} processes{how}: start it with `torchrun --nproc_per_node {n} -m qwen_edit_core.cli sample ...`"


def _check_group(degree: int, cfg_split: bool) -> tuple[int, int]:
    """(rank, world size) of the running process group, which must have `processes_needed` processes."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"context parallel over {degree} processes needs a process group of "
                         f"{_launch_hint(degree, cfg_split)}")
    world = dist.get_world_size()
    if world != processes_needed(degree, cfg_split):
        raise ValueError(f"--context-parallel {degree} but the process group has {world} processes; it needs "
                         f"{_launch_hint(degree, cfg_split)}")
    return dist.get_rank(), world


def check_backend(backend: str, device_type: str) -> None:
    """The group's backend (`torch.distributed.get_backend()`, e.g. "gloo" or "cpu:gloo,cuda:nccl") must run
    the collectives context parallelism uses (all-to-all, all-gather) on `device_type` tensors."""
    needed = BACKENDS.get(device_type)
    if needed is None:
        raise ValueError(f"context parallel runs on {' or '.join(BACKENDS)} devices, not {device_type}: put the "
                         "transformer on a CUDA GPU or the CPU")
    if needed not in backend:
        raise ValueError(f"the process group's backend {backend!r} has no collectives for {device_type} tensors "
                         f"(all-to-all, all-gather); context parallel on {device_type} needs {needed}: initialise "
                         f"the group with backend 'cpu:gloo,cuda:nccl', or let qwen-edit join it")


def init_process_group(degree: int, device: torch.device, cfg_split: bool = False) -> None:
    """Join the `torchrun` group (gloo for CPU tensors, NCCL for CUDA ones); refuses a run started without
    enough processes (`processes_needed`). A no-op when this process is in a group already."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != processes_needed(degree, cfg_split):
        raise ValueError(f"--context-parallel {degree} needs {_launch_hint(degree, cfg_split)}; this run has "
                         f"{world}")
    dist.init_process_group(group_backend(device))


def group_backend(device) -> str:
    """The backend string for a group running the transformer on `device`. gloo for the CPU tensors in every
    case: diffusers' uneven ("anything") splits exchange the per-process token counts as CPU tensors when the
    group has a CPU backend (diffusers 0.42 `gather_size_by_comm`)."""
    import torch.distributed as dist

    if not dist.is_gloo_available():
        raise ValueError("context parallel needs torch.distributed's gloo backend (for the token counts), "
                         "which this torch build lacks")
    return "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "cpu:gloo"


def process_device(device: str) -> str:
    """The transformer's device for this process: under torchrun on GPUs, the GPU of LOCAL_RANK."""
    if device.startswith("cuda") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


def enable(transformer: torch.nn.Module, degree: int, mode: str = "ulysses",
           cfg_split: bool = False) -> CfgSplit | None:
    """Split `transformer`'s tokens over `degree` processes of the running group (in place, once).

    `mode`: "ulysses" (all-to-all over the attention heads: the degree must divide the head count; any device)
    or "ring" (keys and values passed around the ring, with cuDNN attention: CUDA only); both accept token counts
    that do not divide evenly. `cfg_split`: the group has 2 x `degree` processes, the first half running the
    cond branch and the second the uncond one; returns this process's CfgSplit (else None)."""
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    if getattr(transformer, "_parallel_config", None) is not None:
        if cfg_split:
            raise ValueError("this transformer is context-parallel already: load it again to split CFG too")
        return None
    device = _check_transformer(transformer, degree, mode)
    if mode == "ring":
        _ring_backend(transformer, device)
    init_process_group(degree, device, cfg_split)  # a no-op when the caller joined the group already
    rank, world = _check_group(degree, cfg_split)
    import torch.distributed as dist
    check_backend(str(dist.get_backend()), device.type)
    # "anything": token counts need not divide by the degree (prompts have any length).
    cp = ContextParallelConfig(ulysses_degree=degree, ulysses_anything=True) if mode == "ulysses" else \
        ContextParallelConfig(ring_degree=degree, ring_anything=True)
    # One mesh over every process: ("cfg": the two CFG halves, or one) x the context-parallel dimensions, which
    # diffusers reads by name, so each half splits its tokens among its own processes.
    mesh = init_device_mesh(device.type, (world // degree, *cp.mesh_shape),
                            mesh_dim_names=("cfg", *cp.mesh_dim_names))
    config = ParallelConfig(context_parallel_config=cp)
    config.setup(rank, world, device, mesh=mesh)
    transformer._parallel_config = config
    for processor in transformer.attn_processors.values():
        processor._parallel_config = config
    apply_context_parallel(transformer, cp, transformer._cp_plan)
    log.info("context parallel: %s over %d processes (this is rank %d of %d%s)", mode, degree, rank, world,
             f", {'uncond' if rank >= degree else 'cond'} branch" if cfg_split else "")
    return CfgSplit(uncond=rank >= degree, group=mesh["cfg"].get_group()) if cfg_split else None


def _check_transformer(transformer: torch.nn.Module, degree: int, mode: str) -> torch.device:
    """The transformer's device, once its attention processors and head count allow the split."""
    if mode not in CP_MODES:
        raise ValueError(f"context-parallel mode {mode!r} is not accepted; accepted: {', '.join(CP_MODES)}")
    processors = {type(p).__name__ for p in transformer.attn_processors.values()}
    if any(not hasattr(p, "_parallel_config") for p in transformer.attn_processors.values()):
        raise ValueError(f"context parallel needs diffusers' own attention processor; this transformer runs "
                         f"{', '.join(sorted(processors))} (the multi-resolution adapter of training and batched "
                         "sampling), which cannot exchange tokens between processes: sample from a fresh load")
    if transformer.config.num_attention_heads % degree and mode == "ulysses":
        raise ValueError(f"ulysses context parallel splits the {transformer.config.num_attention_heads} attention "
                         f"heads over {degree} processes: use a degree that divides it, or --cp-mode ring")
    return next(transformer.parameters()).device


def _ring_backend(transformer: torch.nn.Module, device: torch.device) -> None:
    """Ring attention merges partial results with their log-sum-exp, which PyTorch's SDPA does not return
    (diffusers 0.42: "Native attention does not support return_lse=True"); cuDNN's attention through diffusers'
    `_native_cudnn` backend does, on CUDA only."""
    if device.type != "cuda":
        raise ValueError("ring context parallel needs an attention kernel that returns the log-sum-exp (cuDNN or "
                         f"flash attention, CUDA only); on {device.type} use --cp-mode ulysses")
    transformer.set_attention_backend("_native_cudnn")
