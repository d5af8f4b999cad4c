"""The LoRA training loop as named steps over one explicit run state.

`train` reads top to bottom: `setup` (levers, optimizer, sampler, resume), then per optimizer step
`micro_step` x gradient_accumulation_steps, `optimizer_step`, `after_step` (log, progress, validation,
checkpoint); a cancel rewinds the data position; `finish` writes the final checkpoint, LoRA and plot.
The maths of one micro-step (batches, dropout, noise, loss) lives in `train.batch`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from diffusers.training_utils import cast_training_params

from qwen_edit_core import speed
from qwen_edit_core.adapters import lora as lora_mod, multires
from qwen_edit_core.common.files import writing
from qwen_edit_core.common.progress import Cancelled, CancelToken, Progress, ProgressFn
from qwen_edit_core.config import Config, to_dict
from qwen_edit_core.data.dataset import BucketBatchSampler, EditExample
from qwen_edit_core.families import family_of
from qwen_edit_core.train import checkpoint as ckpt
from qwen_edit_core.train.ema import LoraEma
from qwen_edit_core.train.validation import RegionLosses
from qwen_edit_core.train.batch import collate, flow_loss, sample_generator  # noqa: F401 (re-exported)
from qwen_edit_core.train.distributed import (Distributed, PaddingMeter, image_tokens, local_device,  # noqa: F401
                                              sequence_tokens)
from qwen_edit_core.train.log import LossLog, plot_loss
from qwen_edit_core.train.prefetch import Prefetcher
from qwen_edit_core.speed.device_use import run_storages
from qwen_edit_core.train.optim import SCHEDULES, make_lr_scheduler, make_optimizer, trainable_parameters  # noqa: F401

log = logging.getLogger(__name__)

#: "equal": one bucket per batch (so one control count); "similar": neighbouring sizes and any control counts
#: share a batch; "similar-count": neighbouring sizes, one control count per batch
BUCKET_GROUPINGS = ("equal", "similar", "similar-count")
#: masked pairs whose region losses validation reports
REGION_SAMPLES = 4
PRECISIONS = {"no": None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainResult:
    """What a run leaves: its final state ("done", "cancelled"), step, LoRA file and loss history."""

    state: str
    step: int
    lora_path: Path | None
    loss_plot: Path | None
    history: list[tuple[int, float]] = field(default_factory=list)
    validation_images: list[Path] = field(default_factory=list)
    #: (step, masked-region loss, unmasked loss) at each validation step, for datasets with masks
    region_losses: list[tuple[int, float, float]] = field(default_factory=list)
    #: (step, latent mse, pixel mse, in mask, out of mask) of the held-out pairs (train.validation_pairs)
    validation_metrics: list[tuple] = field(default_factory=list)


@dataclass
class RunState:
    """Everything one run mutates, in one place: the steps below read and update it."""

    config: Config
    transformer: torch.nn.Module
    model: torch.nn.Module  # the transformer, wrapped for data parallel when there are several processes
    dist: Distributed
    device: torch.device
    base_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    params: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    lr_scheduler: object
    scaler: torch.amp.GradScaler
    sampler: BucketBatchSampler
    bucket_keys: Sequence
    out_dir: Path
    scheduler_config: dict  # the noise schedule's config (mu for the timestep shift)
    padding: PaddingMeter = field(default_factory=PaddingMeter)
    losslog: LossLog | None = None
    batches: Prefetcher | None = None  # the batch order, items read ahead (`batches`); its position is the run's
    step: int = 0
    position: dict = field(default_factory=dict)  # the data position before this step's batches
    last_saved: int = -1
    state: str = "done"
    ema: LoraEma | None = None  # the LoRA's moving average (train.ema_decay > 0)
    regions: RegionLosses | None = None  # masked/unmasked validation losses (datasets with masks)
    #: the steps since the last host read: their device losses and skip flags, read together (`read_pending`)
    pending: list = field(default_factory=list)
    #: this step's loss on the device (set before `optimizer_step`, which skips the update when it is not finite)
    step_loss: torch.Tensor | None = None
    #: this step's skip flag on the device (0-d float32, 1 where the update was skipped), set by `optimizer_step`
    step_skip: torch.Tensor | None = None
    stop: bool = False  # several processes agreed to stop (at the last host read)
    examples: Sequence[EditExample] = ()  # named in the non-finite step's message
    drawn: list = field(default_factory=list)  # the example indices of this step's batches
    skipped: int = 0  # steps skipped for a non-finite loss
    progress: ProgressFn | None = None  # also told of every checkpoint and validation file the run writes
    run_id: str | None = None  # recorded in each checkpoint: pruning and --resume keep to this run's own


class NonFiniteLossError(ValueError):
    """The loss became NaN/Inf more often than train.skip_nonfinite_steps allows; the last checkpoint stays."""


def _autocast_dtype(name: str) -> torch.dtype | None:
    if name not in PRECISIONS:
        raise ValueError(f"train.mixed_precision {name!r} is not accepted; accepted: {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


def _batch_sampler(config: Config, bucket_keys: Sequence, world: int) -> BucketBatchSampler:
    if world > 1 and config.data.batch_size % world:
        raise ValueError(f"data.batch_size {config.data.batch_size} must be a multiple of the number of processes "
                         f"({world}): each process takes an equal share of the global batch")
    grouping = config.data.bucket_grouping
    if grouping not in BUCKET_GROUPINGS:
        raise ValueError(f"data.bucket_grouping {grouping!r} is not accepted; accepted: "
                         f"{', '.join(BUCKET_GROUPINGS)}")
    similar = grouping != "equal"
    # Several processes need full batches (an empty share would stall the gradient all-reduce).
    return BucketBatchSampler(bucket_keys, batch_size=config.data.batch_size, seed=config.train.seed,
                              drop_last=world > 1, sizes=[image_tokens(k) for k in bucket_keys] if similar else None,
                              groups=[len(k[1]) for k in bucket_keys] if grouping == "similar-count" else None)


def setup(config: Config, transformer, bucket_keys: Sequence, out_dir: Path, resume: Path | None,
          scheduler_config: dict) -> RunState:
    """Levers, optimizer, schedule and batch order for the LoRA already injected into `transformer`;
    restored from `resume` (a checkpoint directory) when given."""
    t = config.train
    dist = Distributed(config)
    param = next(iter(trainable_parameters(transformer).values()), None)
    if param is None:
        raise ValueError("the transformer has no trainable parameters: inject a LoRA first")
    device = param.device if dist.accelerator is None else dist.accelerator.device
    autocast_dtype = _autocast_dtype(t.mixed_precision)
    multires.install(transformer)  # exact mixed-resolution batches; no-op numerics for uniform ones
    # fp8 base, selective checkpointing, offloading, compile; `gradient_checkpointing` alone = every block.
    tokens = sequence_tokens(bucket_keys, config.model.variant, config.data.vl_area)
    speed.configure_training(transformer, t, device, tokens=tokens, shards=dist.world if dist.fsdp else 1)
    # peft gives adapters the base layer's dtype (bf16 on a bf16 base, fp32 beside an fp8 one): the LoRA and
    # its AdamW state train in fp32 whatever the base, so no speed lever changes the optimizer's precision.
    cast_training_params(transformer, dtype=torch.float32)
    transformer.train()
    params = trainable_parameters(transformer)
    optimizer = make_optimizer(list(params.values()), config)
    run = RunState(config=config, transformer=transformer, model=dist.wrap(transformer), dist=dist, device=device,
                   base_dtype=transformer.img_in.weight.dtype, autocast_dtype=autocast_dtype, params=params,
                   optimizer=optimizer, lr_scheduler=make_lr_scheduler(optimizer, config),
                   scaler=torch.amp.GradScaler(device.type, enabled=autocast_dtype is torch.float16),
                   sampler=_batch_sampler(config, bucket_keys, dist.world), bucket_keys=bucket_keys, out_dir=out_dir,
                   scheduler_config=scheduler_config)
    if t.ema_decay:
        run.ema = LoraEma(params, t.ema_decay)
    if resume is not None:
        run.step = run.last_saved = _restore(resume, run)
        log.info("resumed from %s at step %d", resume, run.step)
    if dist.is_main:
        run.losslog = LossLog(out_dir, tensorboard=config.logging.tensorboard, start_step=run.step)
    run.position = run.sampler.state_dict()
    return run


def batches(run: RunState, load_item: Callable[[int], dict], ahead: int) -> Prefetcher:
    """The run's batches, each with this process's share of its items (`load_item`), read `ahead` batches
    ahead in a background thread (0: when taken); the data position stays the last batch taken."""
    dist = run.dist
    return Prefetcher(run.sampler, lambda indices: [load_item(i) for j, i in enumerate(indices)
                                                    if j % dist.world == dist.rank], ahead=ahead)


def micro_step(run: RunState, micro: int) -> torch.Tensor:
    """Forward and backward of this process's share of one micro-batch; returns its share of the step's loss
    as a detached device tensor (read on the host only when logged: `after_step`)."""
    config, dist = run.config, run.dist
    accum = config.train.gradient_accumulation_steps
    drawn = next(run.batches)
    indices = drawn.indices
    run.drawn.extend(indices)
    mine = [(j, i) for j, i in enumerate(indices) if j % dist.world == dist.rank]
    items = drawn.items.result()  # this process's share, read while the step before ran (`batches`)
    run.padding.add([run.bucket_keys[i] for i in indices], drawn.epoch)
    gens = [sample_generator(config.train.seed, run.step, micro, j) for j, _ in mine]
    batch = collate(items, gens, caption_dropout=config.data.caption_dropout_rate,
                    control_dropout=config.data.prompt_image_dropout_rate, device=run.device, dtype=run.base_dtype,
                    family=family_of(run.transformer))
    dtype = run.autocast_dtype
    with dist.no_sync(run.model, micro == accum - 1), \
            torch.autocast(run.device.type, dtype=dtype or torch.float32, enabled=dtype is not None), \
            speed.attention_kernel(config.train.attention, run.device):  # around backward too: checkpoint recompute
        loss, _ = flow_loss(run.model, batch, config, run.scheduler_config)
        # Each rank averages its share; DDP averages ranks; equal shares make it the global mean.
        run.scaler.scale(loss * len(mine) * dist.world / len(indices) / accum).backward()
    return loss.detach() * (len(mine) / len(indices) * dist.world / accum)


def optimizer_step(run: RunState) -> None:
    """Unscale, clip, step the optimizer and the schedule, clear the gradients; the step count advances.

    No host read: a step whose loss (`run.step_loss`) or LoRA gradient norm is not finite leaves the LoRA, the
    optimizer state and the EMA exactly as they were, through a device flag (`run.step_skip`) that fused AdamW
    takes as `found_inf` (GradScaler's protocol); the flag is read with the loss at the next logging step
    (`read_pending`). The step count and the schedule advance either way. With several processes only the
    gradients (averaged, so the same on every process) decide: a process's non-finite loss reaches them."""
    run.dist.sync_gradients(run.params.values())
    run.scaler.unscale_(run.optimizer)
    params = [p for p in run.params.values() if p.grad is not None]
    if run.config.train.max_grad_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, run.config.train.max_grad_norm)
    elif params:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    else:
        norm = torch.zeros((), device=run.device)
    finite = torch.isfinite(norm)
    if run.step_loss is not None and run.dist.world == 1:
        finite = finite & torch.isfinite(run.step_loss)
    run.step_skip = (~finite).to(torch.float32)
    if run.scaler.is_enabled():
        # fp16: the scaler skips steps whose gradients overflow (its own flag; a non-finite loss gives such
        # gradients); only a non-finite loss counts as a skipped step
        run.scaler.step(run.optimizer)
        run.scaler.update()
        if run.step_loss is not None:
            run.step_skip = (~torch.isfinite(run.step_loss)).to(torch.float32)
    elif skips_on_device(run.optimizer):
        run.optimizer.found_inf = run.step_skip
        try:
            run.optimizer.step()
        finally:
            del run.optimizer.found_inf
    elif bool(finite):  # an optimizer without a device-side skip (bitsandbytes): one host read per step
        run.optimizer.step()
    run.lr_scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    if run.ema is not None:
        run.ema.update(run.params, skip=run.step_skip)
    run.step += 1


def skips_on_device(optimizer) -> bool:
    """Whether `optimizer.step` takes a device `found_inf` flag and skips the whole update where it is 1 (torch's
    fused Adam/AdamW: `torch._fused_adamw_`, which also takes back the step count's increment)."""
    return isinstance(optimizer, torch.optim.Adam) and bool(optimizer.defaults["fused"])


@dataclass(frozen=True)
class PendingStep:
    """One optimizer step not yet read on the host: its number, device loss and skip flag, and its samples."""

    step: int
    loss: torch.Tensor
    skip: torch.Tensor
    drawn: tuple[int, ...]


def read_due(run: RunState) -> bool:
    """Whether this step reads the device: every `logging.every` steps, at the last step and before a
    checkpoint (a step skipped for a non-finite loss must be counted before a checkpoint keeps the run)."""
    t, step = run.config.train, run.step
    return (step % max(1, run.config.logging.every) == 0 or step >= t.max_steps
            or bool(t.checkpoint_every and step % t.checkpoint_every == 0))


def read_pending(run: RunState, cancel: CancelToken | None = None) -> float | None:
    """Read the pending steps' losses and skip flags in one host read (with several processes, one all-reduce
    that also agrees on a stop: `run.stop`); count and name the skipped steps (`nonfinite_step`). Returns the
    mean loss of the steps not skipped (None when every step was skipped or none is pending)."""
    pending, run.pending = run.pending, []
    if not pending:
        return None
    values = torch.stack([p.loss.reshape(()).float() for p in pending] + [p.skip.reshape(()) for p in pending])
    several = run.dist.world > 1
    if several:
        stop = cancel is not None and cancel.cancelled
        values = torch.cat([values, torch.tensor([1.0 if stop else 0.0], device=values.device)])
    read = run.dist.sum_read(values)
    n = len(pending)
    if several:
        run.stop = run.stop or read[-1] > 0
    kept = []
    for p, loss, skip in zip(pending, [v / run.dist.world for v in read[:n]], read[n:2 * n]):
        if skip > 0 or not math.isfinite(loss):
            nonfinite_step(run, loss, p)
        else:
            kept.append(loss)
    return sum(kept) / len(kept) if kept else None


def storages_reader(transformer: torch.nn.Module, optimizer, device: torch.device) -> Callable[[], dict[int, int]]:
    """A "train" event's `device_storages`: `run_storages` of the run's transformer and optimizer, holding both
    weakly, so a consumer that keeps its events (a test, a log) does not keep the model and the optimizer state
    alive after the run; {} once either is gone."""
    model = weakref.ref(transformer)
    state = weakref.ref(optimizer) if optimizer is not None else None

    def read() -> dict[int, int]:
        held, opt = model(), state() if state is not None else None
        if held is None or (state is not None and opt is None):
            return {}  # the run is over: nothing of it is on the device any more
        return run_storages(held, opt, device)
    return read


def after_step(run: RunState, loss: torch.Tensor, write_lora, progress: ProgressFn | None, validate,
               cancel: CancelToken | None = None) -> None:
    """Log the loss when due (the one host read of a logging interval: `read_pending`), report progress,
    validate and checkpoint when due."""
    t, step = run.config.train, run.step
    run.pending.append(PendingStep(step, loss, run.step_skip, tuple(run.drawn)))
    loss = read_pending(run, cancel) if read_due(run) else None
    if run.losslog is not None and loss is not None:
        run.losslog.add(step, loss, run.lr_scheduler.get_last_lr()[0])
    if progress is not None:
        # a reader, not the reading: only a consumer that keeps a ledger (a background job) walks the storages
        progress(Progress("train", step, t.max_steps, loss=loss,
                          device_storages=storages_reader(run.transformer, run.optimizer, run.device)))
    if t.validation_every and step % t.validation_every == 0:
        if progress is not None:
            progress(Progress("device", step, t.max_steps))
        if run.dist.is_main or run.dist.fsdp:
            # With FSDP the sharded forward passes need every process; only the first one writes.
            ema = run.ema is not None and t.ema_validation
            with run.ema.applied(run.params) if ema else contextlib.nullcontext():
                if validate is not None:
                    written = validate(step) if run.dist.is_main else validate(step, write=False)
                    if written is not None and progress is not None:
                        progress(Progress("validation", step, t.max_steps, path=written))
                if run.regions is not None:
                    run.regions(run.transformer, step, write=run.dist.is_main)
            run.transformer.train()
        # Every rank waits here (distributed.COLLECTIVE_TIMEOUT), not inside the next step's all-reduce.
        run.dist.barrier()
    if t.checkpoint_every and step % t.checkpoint_every == 0:
        save_checkpoint(run, write_lora)


def save_checkpoint(run: RunState, write_lora: Callable[[Path, int], None]) -> None:
    """Checkpoint the current step (rank 0 writes; every rank waits), once per step; prune old ones."""
    at, root = run.step, run.out_dir / "checkpoints"
    if run.dist.is_main and at != run.last_saved:
        path = ckpt.save_checkpoint(root, at, adapter={k: p.detach() for k, p in run.params.items()},
                             optimizer=run.optimizer.state_dict(),
                             state={"lr_scheduler": run.lr_scheduler.state_dict(),
                                    "sampler": run.batches.state_dict(), "config": to_dict(run.config),
                                    "run_id": run.run_id},
                             write_lora=lambda path: write_lora(path, at),
                             ema=run.ema.state_dict() if run.ema is not None else None, device=run.device)
        ckpt.prune(root, run.config.train.keep_checkpoints, run.run_id)
        if run.progress is not None:
            run.progress(Progress("checkpoint", at, run.config.train.max_steps, path=path))
    run.last_saved = at
    run.dist.barrier()


def cancel_step(run: RunState) -> None:
    """Stop at the last completed step: the half-accumulated gradient is discarded and the batch order
    rewound to that step's boundary, so a resume redraws the batches of the step that did not finish (none when
    the stop came after the optimizer step, e.g. during validation)."""
    run.optimizer.zero_grad(set_to_none=True)
    run.state = "cancelled"
    run.batches.load_state_dict(run.position)
    if run.dist.world == 1:  # several processes stop only where they agreed, at a read: nothing is pending then
        read_pending(run)  # the steps since the last read: a non-finite one is counted before the checkpoint
    log.info("training stopped at step %d; saving a checkpoint", run.step)


def nonfinite_step(run: RunState, loss: float, pending: PendingStep) -> None:
    """A step whose loss (or gradient) was NaN or Inf: its update was skipped on the device, so the LoRA stayed as
    it was. Counted while `train.skip_nonfinite_steps` allows; then NonFiniteLossError names the step and samples
    (nothing more is written: the last checkpoint stays the newest)."""
    run.skipped += 1
    names = ", ".join(run.examples[i].name for i in pending.drawn) if run.examples else "?"
    where = f"step {pending.step} (samples: {names})"
    limit = run.config.train.skip_nonfinite_steps
    if run.skipped > limit:
        found = ckpt.latest_checkpoint(run.out_dir / "checkpoints")
        kept = (f"the checkpoint at step {found.step} is intact ({found.path})" if found is not None
                else "no checkpoint had been written yet")
        raise NonFiniteLossError(
            f"training stopped: the loss is {loss} at {where}; {kept}. Lower optimizer.lr, train in float32, "
            "check those samples, or let train.skip_nonfinite_steps skip such steps")
    log.warning("the loss is %s at %s: step skipped (%d of train.skip_nonfinite_steps=%d)", loss, where,
                run.skipped, limit)


def finish(run: RunState, write_lora: Callable[[Path, int], None]) -> TrainResult:
    """The final checkpoint, the user-facing LoRA file and the loss plot."""
    if run.step > 0:
        save_checkpoint(run, write_lora)
    run.transformer.eval()
    t, lora_path, plot_path = run.config.train, None, None
    history = run.losslog.history if run.losslog is not None else []
    if run.dist.is_main and run.step > 0:
        lora_path = run.out_dir / f"{t.lora_name}.safetensors"
        with writing(lora_path, f"the LoRA of step {run.step}", "The checkpoints are unchanged."):
            write_lora(lora_path, run.step)
            if run.ema is not None:
                with run.ema.applied(run.params):
                    write_lora(run.out_dir / f"{t.lora_name}_ema.safetensors", run.step)
        if run.config.logging.plot:
            plot_path = run.out_dir / "loss.png"
            plot_loss(history, plot_path)
    return TrainResult(state=run.state, step=run.step, lora_path=lora_path, loss_plot=plot_path, history=history)


def train(config: Config, transformer, load_item: Callable[[int], dict], examples: Sequence[EditExample],
          bucket_keys: Sequence, *, scheduler_config: dict, write_lora: Callable[[Path, int], None],
          out_dir: Path, resume: Path | None = None, progress: ProgressFn | None = None,
          cancel: CancelToken | None = None, validate: Callable[[int], Path | None] | None = None,
          run_id: str | None = None, read_ahead: bool = False) -> TrainResult:
    """Train the LoRA already injected into `transformer` for `config.train.max_steps` optimizer steps.

    `load_item(i)` returns example i's cache tensors (from the cache, or encoded in real time).
    `write_lora(path, step)` writes the user-facing LoRA file. `resume` is a checkpoint directory. `run_id`
    (train.run_folder) goes into every checkpoint. `read_ahead`: `load_item` touches no device or global RNG
    (a cache read), so the next batch's items are read in a background thread while the current one trains.
    """
    run = setup(config, transformer, bucket_keys, out_dir, resume, scheduler_config)
    run.batches = batches(run, load_item, ahead=1 if read_ahead else 0)
    run.progress, run.examples, run.run_id = progress, examples, run_id
    masked = [i for i, example in enumerate(examples) if example.mask is not None][:REGION_SAMPLES]
    if masked and config.train.validation_every:
        run.regions = RegionLosses([load_item(i) for i in masked], config, scheduler_config, out_dir)
    started = time.perf_counter()
    try:
        while run.step < config.train.max_steps:
            # Capture the data position before drawing this step's batches: a checkpoint saved at the end of
            # the step must resume at the position after them, one saved on cancel at the position before.
            run.position, run.drawn = run.batches.state_dict(), []
            if progress is not None:  # what the caller held back for this step is the step's now
                progress(Progress("device", run.step + 1, config.train.max_steps))
            total = None
            for micro in range(config.train.gradient_accumulation_steps):
                if stop_requested(run, cancel):
                    raise Cancelled("cancelled by request")
                share = micro_step(run, micro)
                total = share if total is None else total + share
            # No host read here: a non-finite loss skips the update on the device (`optimizer_step`) and is
            # counted at the next read (`read_pending`).
            run.step_loss = total
            with cancel.shielded() if cancel is not None else contextlib.nullcontext():
                optimizer_step(run)
                # From here the state is step `run.step`'s boundary: a stop during validation or a checkpoint
                # write must save the position after this step's batches, not rewind to before them.
                run.position = run.batches.state_dict()
            after_step(run, total, write_lora, progress, validate, cancel)
    except (Cancelled, KeyboardInterrupt):
        cancel_step(run)
    finally:
        run.batches.close()
        run.padding.flush()
        if run.losslog is not None:
            run.losslog.close()
    if progress is not None:  # the steps are over: what the caller held back for the next one is not needed
        progress(Progress("device", run.step, config.train.max_steps))
    result = finish(run, write_lora)
    result.region_losses = run.regions.history if run.regions is not None else []
    stats = speed.compile_stats(transformer)  # what compiled, so a slow start or a fallback is explained
    log.info("training %s at step %d (%.1f s)%s", run.state, run.step, time.perf_counter() - started,
             f"; {stats.summary()}" if stats is not None else "")
    return result


def stop_requested(run: RunState, cancel: CancelToken | None) -> bool:
    """Whether to stop before the next micro-step. One process: the cancel token (a host flag, no device read).
    Several: what they agreed at the last host read (`read_pending`: a signal reaches each process at a slightly
    different point, so each stops at the same step; a stop asked of one is seen within `logging.every` steps)."""
    if run.dist.world > 1:
        return run.stop
    return cancel is not None and cancel.cancelled


def _restore(path: Path, run: RunState) -> int:
    """Load checkpoint `path` into the run's LoRA, optimizer, schedule, batch order, EMA and RNGs; its step."""
    params, optimizer, lr_scheduler, sampler, ema = run.params, run.optimizer, run.lr_scheduler, run.sampler, run.ema
    checkpoint, adapter, optimizer_state, rng = ckpt.read_checkpoint(path)
    missing = sorted(set(params) - set(adapter))
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} does not match this LoRA (missing {missing[:3]}); "
                         "resume with the same model.lora settings")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(adapter[name].to(p.device, p.dtype))
    extra = set(adapter) - set(params)
    unreached = lora_mod.unreached_modules(run.transformer)
    foreign = sorted(n for n in extra if lora_mod.split_parameter_name(n)[0] not in unreached)
    if foreign:
        raise ValueError(f"checkpoint {str(path)!r} does not match this LoRA (it also trains {foreign[:3]}); "
                         "resume with the same model.lora settings")
    if extra:  # written while the LoRA also sat on modules this version leaves out
        saved = ckpt.saved_order([m for m, _ in run.transformer.named_modules()], list(adapter), list(params),
                                 lora_mod.split_parameter_name)
        optimizer_state = ckpt.narrow_optimizer_state(optimizer_state, saved, list(params))
        log.info("checkpoint %s: %d adapter tensor(s) this LoRA no longer trains are left out", path,
                 len(saved) - len(params))
    optimizer.load_state_dict(optimizer_state)
    lr_scheduler.load_state_dict(checkpoint.state["lr_scheduler"])
    sampler.load_state_dict(checkpoint.state["sampler"])
    if ema is not None:
        ema.load_state_dict(ckpt.read_ema(path, params))
    ckpt.set_rng_state(rng, run.device)
    return checkpoint.step


def resolve_resume(out_dir: Path, resume: str | Path | bool | None) -> Path | None:
    """`--resume` with no path: the run's latest complete checkpoint; with a path: that checkpoint (or the
    latest one under that output directory)."""
    if not resume:
        return None
    if resume is True:
        found = ckpt.list_checkpoints(out_dir / "checkpoints")
        if not found:
            raise FileNotFoundError(f"--resume: no complete checkpoint under {str(out_dir / 'checkpoints')!r}")
        runs = {c.state.get("run_id"): c for c in found}  # the newest checkpoint of each run
        if len(runs) > 1:
            newest = ", ".join(str(c.path) for c in runs.values())
            raise ValueError(f"--resume: {str(out_dir / 'checkpoints')!r} holds checkpoints of {len(runs)} runs; "
                             f"give the one to continue (--resume PATH), the newest of each: {newest}")
        return found[-1].path
    path = Path(resume)
    if (path / ckpt.STATE_FILE).is_file():
        return path
    for root in (path / "checkpoints", path):
        found = ckpt.latest_checkpoint(root)
        if found is not None:
            return found.path
    raise FileNotFoundError(f"--resume {str(path)!r}: no complete checkpoint there")


def steps_per_epoch(n_examples: int, batch_size: int) -> int:
    return max(1, math.ceil(n_examples / batch_size))
