"""Data-parallel plumbing (accelerate under `accelerate launch`, a no-op in one process) and the padding meter."""

from __future__ import annotations

import contextlib
import logging
import os
from datetime import timedelta
from typing import Mapping

import torch

from qwen_edit_core.config import Config
from qwen_edit_core.model import encode, prompt_length
from qwen_edit_core.train import sharding

log = logging.getLogger(__name__)


#: How long a rank waits in a collective (gradient all-reduce, barrier) before the run fails. Rank 0 alone
#: samples validation images between steps while the other ranks wait in the next step's all-reduce; torch's
#: default (10 min on NCCL) is shorter than a validation pass of the real model can take.
COLLECTIVE_TIMEOUT = timedelta(hours=2)


def ddp_kwargs() -> list:
    """accelerate's handlers for DDP: no buffer broadcast (the frozen fp8 base weights are buffers, half the
    transformer, that every rank already holds; DDP would send them from rank 0 before every synced forward), every
    trained parameter used (no `find_unused_parameters` graph walk per backward: `adapters.lora.inject_lora` leaves
    out the modules whose output reaches no loss) and the collective timeout above."""
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs
    return [DistributedDataParallelKwargs(broadcast_buffers=False, find_unused_parameters=False),
            InitProcessGroupKwargs(timeout=COLLECTIVE_TIMEOUT)]


def launch_mismatch(env: Mapping[str, str]) -> str | None:
    """What is wrong when `accelerate launch` was asked for several processes and started one (None if nothing).

    accelerate's plain launcher (used with `--cpu`, or when it finds no GPU and is not given `--multi_gpu`)
    runs the script once whatever `--num_processes` says; it still exports MASTER_ADDR/MASTER_PORT for a
    process count above 1 (accelerate 1.15 `prepare_simple_launcher_cmd_env`), but no WORLD_SIZE: every
    multi-process launcher (torchrun underneath `--multi_gpu` and FSDP configs) sets WORLD_SIZE."""
    launched = "ACCELERATE_MIXED_PRECISION" in env  # exported by every accelerate launcher
    if not launched or "WORLD_SIZE" in env or "MASTER_ADDR" not in env:
        return None
    return ("`accelerate launch` was asked for several processes (it set MASTER_ADDR) but started only this one "
            "(no WORLD_SIZE): its plain launcher, used with --cpu or when no GPU is found, runs one process. On the "
            "CPU start them with `accelerate launch --multi_gpu --num_processes N` (torchrun underneath; with "
            "train.device cpu each process trains on the CPU); on GPUs drop --cpu. This run trains as one process.")


class Distributed:
    """Multi-process plumbing: a no-op in one process; under `accelerate launch`, DDP, or FSDP2 when the
    accelerate config asks for it (the frozen base sharded, the LoRA whole: `train.sharding`)."""

    def __init__(self, config: Config):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.accelerator = None
        if self.world > 1:
            from accelerate import Accelerator
            self.accelerator = Accelerator(cpu=config.train.device == "cpu", kwargs_handlers=ddp_kwargs())
        self.rank = self.accelerator.process_index if self.accelerator else 0
        self.is_main = self.rank == 0
        self.fsdp = self.accelerator is not None and sharding.is_fsdp()
        #: LoRA gradients averaged by one all-reduce per optimizer step instead of DDP's hooks (set by `wrap`)
        self.manual = self.fsdp
        if self.world > 1 and self.is_main:
            log.info("training on %d processes (%s)", self.world, "FSDP2" if self.fsdp else "data parallel")

    def wrap(self, model):
        """The model for the forward passes: FSDP2-sharded, DDP-wrapped, or as it is. A model of a family whose
        micro-batch runs one forward per token layout (not `Family.padded_batches`) is never DDP-wrapped: DDP's
        once-per-backward hooks refuse several forwards, so its LoRA gradients are averaged in `sync_gradients`
        (as under FSDP)."""
        from qwen_edit_core.families import family_of
        if self.fsdp:
            return sharding.shard_frozen_base(model, self.accelerator.device, self.world)
        if self.accelerator is not None and not family_of(model).padded_batches:
            self.manual = True
            return model
        if self.accelerator is None:
            return model
        ignore_frozen(model)
        return self.accelerator.prepare_model(model)

    def no_sync(self, model, last_micro: bool):
        if self.accelerator is None or last_micro or self.manual:  # gradients averaged in `sync_gradients`
            return contextlib.nullcontext()
        return model.no_sync()

    def sync_gradients(self, params) -> None:
        """Average the LoRA gradients over processes where the wrapper does not (FSDP keeps the LoRA whole)."""
        if self.manual:
            sharding.average_gradients(list(params), self.world)

    def sum_read(self, values: torch.Tensor) -> list[float]:
        """A 1-D device tensor summed over processes (one all-reduce) and read on the host once: the training
        loop's one host read per logging interval (`train.loop.read_pending`)."""
        if self.accelerator is not None:
            values = self.accelerator.reduce(values, reduction="sum")
        return values.tolist()

    def barrier(self) -> None:
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()


def ignore_frozen(model: torch.nn.Module) -> int:
    """Leave every frozen parameter and every buffer of `model` out of DistributedDataParallel (torch's
    `_set_params_and_buffers_to_ignore_for_model`, read when DDP wraps the model): DDP broadcasts from rank 0 at wrap
    every parameter and buffer it is not told to ignore (`_sync_module_states`), which for the frozen base is the whole
    transformer (docs/MODEL.md, "The real model's sizes") that every process already loaded from the same files; frozen
    weights have no gradients to average. Returns how many names are ignored."""
    from torch.nn.parallel import DistributedDataParallel
    names = [n for n, p in model.named_parameters() if not p.requires_grad] + [n for n, _ in model.named_buffers()]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    return len(names)


def image_tokens(bucket_key) -> int:
    """Image tokens of a bucket key ((target w, h), ((control w, h), ...)) for size grouping."""
    target, controls = bucket_key
    return sum(w * h // (encode.LATENT_MULTIPLE ** 2) for w, h in (target, *controls))


def sequence_tokens(bucket_keys, variant: str | None, vl_area: int = prompt_length.DEFAULT_VL_AREA) -> int:
    """The longest sequence (image plus text tokens) of one sample in these buckets, which the memory planner
    plans for: the text holds the control images' vision tokens (model/prompt_length.py). `variant` empty: the
    longest prompt any variant taking the bucket's control count would give."""
    return max(image_tokens(k) + prompt_length.prompt_tokens(variant, k[1], vl_area) for k in bucket_keys)


class PaddingMeter:
    """Logs the fraction of padded image tokens of each epoch (0 when every batch holds one bucket)."""

    def __init__(self) -> None:
        self.epoch, self.real, self.padded = None, 0, 0

    def add(self, keys, epoch: int) -> None:
        if self.epoch is not None and epoch != self.epoch:
            self.flush()
        self.epoch = epoch
        tokens = [image_tokens(k) for k in keys]
        self.real += sum(tokens)
        self.padded += max(tokens) * len(tokens) - sum(tokens)

    def flush(self) -> None:
        if self.real:
            # Only worth a line when batches mix sizes; one-bucket batches are never padded.
            log.log(logging.INFO if self.padded else logging.DEBUG, "epoch %d: %.1f%% of image tokens were padding",
                    self.epoch, 100 * self.padded / (self.real + self.padded))
        self.real = self.padded = 0


def local_device(name: str) -> str:
    """The transformer's device for this process: under `accelerate launch` on GPUs, each process takes the
    GPU of its LOCAL_RANK; otherwise the configured device."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and name.startswith("cuda"):
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return name
