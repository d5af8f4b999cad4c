"""The LoRA training loop: batches (cached or realtime) -> flow-matching loss -> optimizer step.

Determinism: every random draw of a sample (noise, timestep, dropout) comes from a generator seeded by
(seed, step, micro-step, the sample's index in the global batch), drawn on the CPU. Nothing depends on the
process rank or on what ran before, so a resumed run, a run on another device and a run split over several
processes (`accelerate launch`) draw the same numbers for the same sample.

Loss: mean over channels and target tokens of each sample, then mean over samples (each sample counts
equally whatever its resolution, so a batch equals the average of one-by-one steps).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

import torch.nn.functional as F

from . import batching, encode, flow, perf
from . import checkpoint as ckpt
from .config import Config, to_dict
from .dataset import BucketBatchSampler, EditExample
from .encode import PromptEmbeds
from .progress import Cancelled, CancelToken, Progress, ProgressFn
from .trainlog import LossLog, plot_loss

log = logging.getLogger(__name__)

SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine")
#: text tokens assumed by the memory planner (a long caption plus the Edit template's prefix)
TEXT_TOKENS = 512
PRECISIONS = {"no": None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class TrainBatch:
    """A batch on the transformer's device: per-sample packed target and control tokens (samples may differ
    in size; `flow_loss` pads them), right-padded prompt embeddings, and each sample's generator."""

    targets: list[torch.Tensor]          # (N_target_b, 64)
    controls: list[torch.Tensor]         # (N_control_b, 64), all control images concatenated
    embeds: PromptEmbeds
    img_shapes: list[list[tuple[int, int, int]]]
    generators: list[torch.Generator]


def sample_generator(seed: int, step: int, micro: int, index: int) -> torch.Generator:
    """The generator of one sample of one micro-step (independent of rank, device and history)."""
    mixed = (seed * 1_000_003 + step * 10_007 + micro * 101 + index) % (2**63 - 1)
    return torch.Generator("cpu").manual_seed(mixed)


def collate(items: Sequence[dict], generators: Sequence[torch.Generator], *, caption_dropout: float,
            control_dropout: float, device: torch.device, dtype: torch.dtype) -> TrainBatch:
    """Per-sample cache tensors -> a batch; applies caption and control dropout.

    Caption dropout swaps in the cached empty-caption embeddings; control dropout zeroes the control latents
    (the mean image in normalized latent space). Each draw uses the sample's own generator.
    """
    embeds, controls, targets, shapes = [], [], [], []
    for item, gen in zip(items, generators):
        drop_caption = torch.rand((), generator=gen).item() < caption_dropout
        drop_control = torch.rand((), generator=gen).item() < control_dropout
        embeds.append(item["empty_prompt_embeds"] if drop_caption else item["prompt_embeds"])
        n_controls = len(item["img_shapes"]) - 1
        control = torch.cat([encode.pack(item[f"control_latents_{i}"][None])[0] for i in range(n_controls)])
        controls.append((torch.zeros_like(control) if drop_control else control).to(device, dtype))
        targets.append(encode.pack(item["target_latents"][None])[0].to(device, dtype))
        shapes.append([tuple(s) for s in item["img_shapes"].tolist()])
    return TrainBatch(targets=targets, controls=controls, embeds=encode.pad_embeddings(embeds).to(device, dtype),
                      img_shapes=shapes, generators=list(generators))


def flow_loss(transformer, batch: TrainBatch, config: Config, scheduler_config: dict) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """Flow-matching loss on each sample's target tokens: predict noise - latents at a sampled sigma.

    Samples of different sizes are padded into one call (batching.pack_samples); padding is masked out of
    attention and of the loss, so each sample's loss equals its one-by-one loss.
    """
    t = config.train
    noisy, velocities, sigmas = [], [], []
    for x0, gen in zip(batch.targets, batch.generators):
        noise = torch.randn(x0.shape, generator=gen, dtype=torch.float32).to(x0.device, x0.dtype)
        mu = flow.mu_from_scheduler_config(scheduler_config, x0.shape[0])
        sigma = flow.sample_sigmas(1, t.timestep_sampling, generator=gen, device="cpu", mu=mu,
                                   logit_mean=t.logit_mean, logit_std=t.logit_std, shift=t.fixed_shift)
        noisy.append(flow.noisy_latents(x0[None], noise[None], sigma.to(x0.device, x0.dtype))[0])
        velocities.append(flow.flow_target(x0, noise))
        sigmas.append(sigma)
    packed = batching.pack_samples(noisy, batch.controls, batch.img_shapes)
    sig = torch.cat(sigmas).to(packed.hidden.device)
    pred = transformer(hidden_states=packed.hidden, timestep=sig.to(packed.hidden.dtype),
                       encoder_hidden_states=batch.embeds.embeds,
                       encoder_hidden_states_mask=batch.embeds.mask_or_none(), img_shapes=packed.img_shapes,
                       attention_kwargs=packed.attention_kwargs, return_dict=False)[0]
    n_max = max(packed.n_target)
    target = torch.stack([F.pad(v, (0, 0, 0, n_max - v.shape[0])) for v in velocities])
    token_mask = None
    if any(n != n_max for n in packed.n_target):
        token_mask = torch.arange(n_max, device=pred.device)[None] < torch.tensor(packed.n_target,
                                                                                   device=pred.device)[:, None]
    weights = flow.loss_weights(t.loss_weighting, sig).to(pred.device)
    return flow.masked_mse(pred[:, :n_max].float(), target.float(), weights, token_mask)


def make_optimizer(params, config: Config):
    params = list(params)
    o = config.optimizer
    if o.type == "adamw":
        return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, eps=o.eps)
    if o.type == "adamw8bit":
        if any(p.device.type != "cuda" for p in params):
            raise ValueError("optimizer.type adamw8bit (bitsandbytes) needs the LoRA on a CUDA device; "
                             "use adamw on this device")
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ValueError("optimizer.type adamw8bit needs bitsandbytes (pip install bitsandbytes) and a CUDA "
                             "device; use adamw") from None
        return bnb.optim.AdamW8bit(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, eps=o.eps)
    raise ValueError(f"optimizer.type {o.type!r} is not accepted; accepted: adamw, adamw8bit")


def make_lr_scheduler(optimizer, config: Config):
    from diffusers.optimization import get_scheduler
    s = config.lr_scheduler
    if s.type not in SCHEDULES:
        raise ValueError(f"lr_scheduler.type {s.type!r} is not accepted; accepted: {', '.join(SCHEDULES)}")
    return get_scheduler(s.type, optimizer, num_warmup_steps=s.warmup_steps,
                         num_training_steps=config.train.max_steps)


@dataclass
class TrainResult:
    """What a run leaves: its final state ("done", "cancelled"), step, LoRA file and loss history."""

    state: str
    step: int
    lora_path: Path | None
    loss_plot: Path | None
    history: list[tuple[int, float]] = field(default_factory=list)
    validation_images: list[Path] = field(default_factory=list)


class _Distributed:
    """Data-parallel plumbing: a no-op in one process; DDP through accelerate under `accelerate launch`."""

    def __init__(self, config: Config):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.accelerator = None
        if self.world > 1:
            from accelerate import Accelerator
            self.accelerator = Accelerator(cpu=config.train.device == "cpu")
        self.rank = self.accelerator.process_index if self.accelerator else 0
        self.is_main = self.rank == 0

    def wrap(self, model):
        return self.accelerator.prepare_model(model) if self.accelerator else model

    def no_sync(self, model, last_micro: bool):
        if self.accelerator is None or last_micro:
            return contextlib.nullcontext()
        return model.no_sync()

    def mean(self, value: float) -> float:
        if self.accelerator is None:
            return value
        tensor = torch.tensor([value], device=self.accelerator.device)
        return float(self.accelerator.reduce(tensor, reduction="mean")[0])

    def barrier(self) -> None:
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()


def _tokens(bucket_key) -> int:
    """Image tokens of a bucket key ((target w, h), ((control w, h), ...)) for size grouping."""
    target, controls = bucket_key
    return sum(w * h // (encode.LATENT_MULTIPLE ** 2) for w, h in (target, *controls))


class _PaddingMeter:
    """Logs the fraction of padded image tokens of each epoch (0 when every batch holds one bucket)."""

    def __init__(self) -> None:
        self.epoch, self.real, self.padded = None, 0, 0

    def add(self, keys, epoch: int) -> None:
        if self.epoch is not None and epoch != self.epoch:
            self.flush()
        self.epoch = epoch
        tokens = [_tokens(k) for k in keys]
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


def trainable_parameters(transformer) -> dict[str, torch.nn.Parameter]:
    """The LoRA parameters, by name, in registration order (the optimizer's order)."""
    return {name: p for name, p in transformer.named_parameters() if p.requires_grad}


def train(config: Config, transformer, load_item: Callable[[int], dict], examples: Sequence[EditExample],
          bucket_keys: Sequence, *, scheduler_config: dict, write_lora: Callable[[Path, int], None],
          out_dir: Path, resume: Path | None = None, progress: ProgressFn | None = None,
          cancel: CancelToken | None = None, validate: Callable[[int], Path | None] | None = None) -> TrainResult:
    """Train the LoRA already injected into `transformer` for `config.train.max_steps` optimizer steps.

    `load_item(i)` returns example i's cache tensors (from the cache, or encoded in real time).
    `write_lora(path, step)` writes the user-facing LoRA file. `resume` is a checkpoint directory.
    """
    t = config.train
    dist = _Distributed(config)
    param = next(iter(trainable_parameters(transformer).values()), None)
    if param is None:
        raise ValueError("the transformer has no trainable parameters: inject a LoRA first")
    device = param.device if dist.accelerator is None else dist.accelerator.device
    base_dtype = transformer.img_in.weight.dtype
    autocast_dtype = PRECISIONS.get(t.mixed_precision, "invalid")
    if autocast_dtype == "invalid":
        raise ValueError(f"train.mixed_precision {t.mixed_precision!r} is not accepted; accepted: "
                         f"{', '.join(PRECISIONS)}")
    batching.install(transformer)  # exact mixed-resolution batches; no-op numerics for uniform ones
    # fp8 base, selective checkpointing, offloading, compile; `gradient_checkpointing` alone = every block.
    perf.configure_training(transformer, t, device, tokens=max(_tokens(k) for k in bucket_keys) + TEXT_TOKENS)
    transformer.train()
    params = trainable_parameters(transformer)
    optimizer = make_optimizer(list(params.values()), config)
    lr_scheduler = make_lr_scheduler(optimizer, config)
    if dist.world > 1 and config.data.batch_size % dist.world:
        raise ValueError(f"data.batch_size {config.data.batch_size} must be a multiple of the number of processes "
                         f"({dist.world}): each process takes an equal share of the global batch")
    # Several processes need full batches (an empty share would stall the gradient all-reduce).
    grouping = config.data.bucket_grouping
    if grouping not in ("equal", "similar"):
        raise ValueError(f"data.bucket_grouping {grouping!r} is not accepted; accepted: equal, similar")
    sampler = BucketBatchSampler(bucket_keys, batch_size=config.data.batch_size, seed=t.seed,
                                 drop_last=dist.world > 1,
                                 sizes=[_tokens(k) for k in bucket_keys] if grouping == "similar" else None)
    padding = _PaddingMeter()
    model = dist.wrap(transformer)
    scaler = torch.amp.GradScaler(device.type, enabled=autocast_dtype is torch.float16)

    step = 0
    ckpt_root = out_dir / "checkpoints"
    if resume is not None:
        step = _restore(resume, params, optimizer, lr_scheduler, sampler)
        log.info("resumed from %s at step %d", resume, step)
    losslog = LossLog(out_dir, tensorboard=config.logging.tensorboard, start_step=step) if dist.is_main else None
    batches = iter(sampler)
    world, rank = dist.world, dist.rank
    accum = t.gradient_accumulation_steps
    state = "done"
    position = sampler.state_dict()
    last_saved = step if resume is not None else -1

    def save(at: int) -> None:
        nonlocal last_saved
        if dist.is_main and at != last_saved:
            ckpt.save_checkpoint(ckpt_root, at, adapter={k: p.detach() for k, p in params.items()},
                                 optimizer=optimizer.state_dict(),
                                 state={"lr_scheduler": lr_scheduler.state_dict(), "sampler": sampler.state_dict(),
                                        "config": to_dict(config)},
                                 write_lora=lambda path: write_lora(path, at))
            ckpt.prune(ckpt_root, t.keep_checkpoints)
        last_saved = at
        dist.barrier()

    started = time.perf_counter()
    try:
        while step < t.max_steps:
            # Capture the data position before drawing this step's batches: a checkpoint saved at the end of
            # the step must resume at the position after them, one saved on cancel at the position before.
            position = sampler.state_dict()
            total = 0.0
            for micro in range(accum):
                if cancel is not None:
                    cancel.check()
                indices = next(batches)
                mine = [(j, i) for j, i in enumerate(indices) if j % world == rank]
                items = [load_item(i) for _, i in mine]
                padding.add([bucket_keys[i] for i in indices], sampler.epoch)
                gens = [sample_generator(t.seed, step, micro, j) for j, _ in mine]
                batch = collate(items, gens, caption_dropout=config.data.caption_dropout_rate,
                                control_dropout=config.data.prompt_image_dropout_rate, device=device,
                                dtype=base_dtype)
                with dist.no_sync(model, micro == accum - 1), torch.autocast(
                        device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None), \
                        perf.attention_kernel(t.attention):  # around backward too: checkpoint recompute
                    loss, _ = flow_loss(model, batch, config, scheduler_config)
                    # Each rank averages its share; DDP averages ranks; equal shares make it the global mean.
                    scaler.scale(loss * len(mine) * world / len(indices) / accum).backward()
                total += loss.item() * len(mine) / len(indices) * world / accum
            scaler.unscale_(optimizer)
            if t.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(list(params.values()), t.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            loss_value = dist.mean(total)
            if losslog is not None:
                losslog.add(step, loss_value, lr_scheduler.get_last_lr()[0])
            if progress is not None:
                progress(Progress("train", step, t.max_steps, loss=loss_value))
            if validate is not None and t.validation_every and step % t.validation_every == 0 and dist.is_main:
                validate(step)
                transformer.train()
            if t.checkpoint_every and step % t.checkpoint_every == 0:
                save(step)
    except (Cancelled, KeyboardInterrupt):
        # Stop cleanly at the last completed step: the half-accumulated gradient is discarded, and the
        # sampler rewound so a resume redraws this step's batches.
        optimizer.zero_grad(set_to_none=True)
        state = "cancelled"
        sampler.load_state_dict(position)
        log.info("training stopped at step %d; saving a checkpoint", step)
    finally:
        padding.flush()
        if losslog is not None:
            losslog.close()
    if step > 0:
        save(step)
    transformer.eval()
    elapsed = time.perf_counter() - started
    log.info("training %s at step %d (%.1f s)", state, step, elapsed)
    lora_path = plot_path = None
    history = losslog.history if losslog is not None else []
    if dist.is_main and step > 0:
        lora_path = out_dir / f"{t.lora_name}.safetensors"
        write_lora(lora_path, step)
        if config.logging.plot:
            plot_path = out_dir / "loss.png"
            plot_loss(history, plot_path)
    return TrainResult(state=state, step=step, lora_path=lora_path, loss_plot=plot_path, history=history)


def _restore(path: Path, params, optimizer, lr_scheduler, sampler) -> int:
    checkpoint, adapter, optimizer_state, rng = ckpt.read_checkpoint(path)
    missing = sorted(set(params) - set(adapter))
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} does not match this LoRA (missing {missing[:3]}); "
                         "resume with the same model.lora settings")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(adapter[name].to(p.device, p.dtype))
    optimizer.load_state_dict(optimizer_state)
    lr_scheduler.load_state_dict(checkpoint.state["lr_scheduler"])
    sampler.load_state_dict(checkpoint.state["sampler"])
    ckpt.set_rng_state(rng)
    return checkpoint.step


def resolve_resume(out_dir: Path, resume: str | Path | bool | None) -> Path | None:
    """`--resume` with no path: the run's latest complete checkpoint; with a path: that checkpoint (or the
    latest one under that output directory)."""
    if not resume:
        return None
    if resume is True:
        found = ckpt.latest_checkpoint(out_dir / "checkpoints")
        if found is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint under {str(out_dir / 'checkpoints')!r}")
        return found.path
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
