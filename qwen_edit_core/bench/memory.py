"""`qwen-edit bench memory`: one real-size training step and one sampling step of each plan, simulated.

The real transformer of a variant (the 2025 family's 60 blocks, 20 B parameters; Qwen-Image-2.1's 32 blocks,
7 B; each family's inputs from its families/<family>/fake_model.py), real token counts and the product's own code
path (`train.loop.setup`: LoRA, levers from the memory planner, checkpointing, offload, AdamW; the step's
`train.batch.flow_loss` and `train.loop.optimizer_step`; the sampler's `sample.sampler.denoise`) run under
torch's FakeTensorMode (bench.fake_model): no weight exists, `MemTracker` counts every byte the step holds,
by device and category, and `FlopCounterMode` its FLOPs. The planner's margin (`speed.planner.MARGIN_*`) adds
what fake tensors cannot see. What is simulated and what is not: docs/MEMORY.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qwen_edit_core.bench import fake_model as fm
from qwen_edit_core.families import variants

log = logging.getLogger(__name__)

GIB = 2**30
#: H100 SXM dense peaks (NVIDIA H100 datasheet): bf16 and fp8 tensor-core FLOP/s
H100_BF16, H100_FP8 = 989e12, 1979e12
#: the reference's measured step on one H100 (BENCHMARKS.md, "Reference timings"): LoRA r16 on the image attention,
#: every block checkpointed, bf16, 1024^2 Edit, no mask; and its one no-grad forward
REFERENCE_STEP_S, REFERENCE_FORWARD_S = 1.91, 0.456
#: the step-time targets (BENCHMARKS.md): a training step, and one sampling step (cond + uncond)
TARGET_TRAIN_S, TARGET_SAMPLE_S = 0.9, 0.5
BUDGETS = (16, 24, 40, 80)
#: sampling levers: cfg_mode per process/device and fp8 base
SAMPLE_LEVERS = ("sequential", "fp8", "batched", "split", "context-parallel-2")


@dataclass(frozen=True)
class Simulated:
    """One simulated plan: its peaks (GiB; the device's with the margin), FLOPs and roofline."""

    plan: str
    kind: str  # "train" or "sample"
    variant: str
    size: int
    controls: int
    image_tokens: int
    text_tokens: int
    budget_gib: float | None
    planner_estimate_gib: float | None
    peak_device_gib: float
    tracked_device_gib: float
    peak_host_gib: float
    flops_per_step: float
    roofline_s: float
    categories_gib: dict = field(default_factory=dict)
    #: bytes of offloaded blocks' weights still on the device after the step (should be 0)
    offloaded_resident_after_gib: float = 0.0
    levers: str = ""
    #: what the card must reserve: the peak with the margin. Offloaded blocks are copied into the offloader's fixed
    #: device buffers (allocated once, tracked), so no in-flight copy waits outside the tracked bytes
    reserved_gib: float = 0.0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def margin_bytes(categories: dict[str, int]) -> int:
    """The margin for what fake tensors cannot see, for a peak snapshot by category: the planner's
    (`speed.planner.MARGIN_*`: CUDA context, cuBLAS workspaces, a fragmentation allowance on the non-weight
    bytes)."""
    from qwen_edit_core.speed import planner
    weights = categories.get("Parameter", 0) + categories.get("Buffer", 0)
    return planner.MARGIN_FIXED + int(planner.MARGIN_FRAGMENTATION * (categories.get("Total", 0) - weights))


def roofline_seconds(flops_by_op: dict) -> float:
    """The step's best time on an H100: fp8 matmuls (`_scaled_mm`) at the fp8 peak, the rest at bf16."""
    fp8 = sum(v for op, v in flops_by_op.items() if "_scaled_mm" in str(op))
    return fp8 / H100_FP8 + (sum(flops_by_op.values()) - fp8) / H100_BF16


#: `--adapter`: the adapter kinds a training row simulates ("dora": a LoRA with `model.lora.dora`). Not LoKr and
#: LoHa: peft's forward of both draws `torch.rand(1) > module_dropout` and branches on it, which fake tensors cannot
#: answer (peft 0.21 `tuners/lokr/layer.py`, `tuners/loha/layer.py`)
ADAPTERS = ("lora", "dora")


def _adapter_keys(adapter: str) -> dict:
    """`model.lora`'s type and dora of an `ADAPTERS` name."""
    if adapter not in ADAPTERS:
        raise ValueError(f"bench memory: --adapter {adapter!r} is not accepted; accepted: {', '.join(ADAPTERS)}")
    return {"type": "lora" if adapter == "dora" else adapter, "dora": adapter == "dora"}


def _config(budget_gb: float, targets: str, fp8: bool = False, variant: str = "", adapter: str = "lora"):
    from qwen_edit_core.config import load_config
    lora = {"rank": 16, "alpha": 16, "targets": targets, **_adapter_keys(adapter)}
    return load_config(None, {"model": {"variant": variant, "lora": lora},
                              "train": {"mixed_precision": "bf16", "gradient_checkpointing": True,
                                        "memory_budget_gb": budget_gb, "fp8_base": fp8}})


def lora_spec(targets: str, variant: str = variants.DEFAULT, adapter: str = "lora"):
    """The simulated adapter: rank 16 (the default `model.lora`) of kind `adapter` (`ADAPTERS`) on `targets` (a
    preset of the variant's family, or names)."""
    from qwen_edit_core.adapters import lora as lora_mod
    presets = variants.get(variant).family.lora_targets
    return lora_mod.LoraSpec(rank=16, alpha=16, targets=lora_mod.resolve_targets(targets, presets),
                             **_adapter_keys(adapter))


def _bucket(side: int, controls: int):
    return ((side, side), ((side, side),) * controls)


def _warm_optimizer(run, mode) -> None:
    """One optimizer step on zero gradients before tracking, so AdamW's state exists as in every step after
    the first (the step tracked is then a steady-state one)."""
    with mode:
        for p in run.params.values():
            p.grad = torch.zeros_like(p)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)


def _offloaded_resident(transformer) -> int:
    """Bytes of the offloaded blocks' frozen tensors on the device now."""
    offloader = getattr(transformer, "_qwen_edit_offloader", None)
    if offloader is None:
        return 0
    return sum(getattr(owner, "_parameters" if is_param else "_buffers")[name].nbytes
               for slots in offloader.slots.values() for owner, name, is_param, _ in slots)


def pinned_host_bytes(transformer) -> int:
    """Pinned host memory the offloaded blocks take on a CUDA device, as torch's caching host allocator rounds
    it: the offloader's one region (`speed.host_memory.pack`'s power-of-two chunks) for their host copies."""
    from qwen_edit_core.speed import host_memory
    offloader = getattr(transformer, "_qwen_edit_offloader", None)
    if offloader is None:
        return 0
    return sum(host_memory.pack([host.nbytes for slots in offloader.slots.values() for *_, host in slots])[0])


def host_bytes(transformer) -> int:
    """Host memory the run holds for the device's weights: the offloaded blocks' pinned region
    (`pinned_host_bytes`) and, on a lent model, the lender's weights parked in pageable memory (speed.lending)."""
    from qwen_edit_core.speed.lending import loan_of
    loan = loan_of(transformer)
    return pinned_host_bytes(transformer) + (loan.parked_bytes if loan is not None else 0)


def _levers_text(transformer, checkpointed: int | None) -> str:
    """The levers in effect: fp8 base, checkpointed and offloaded blocks (`checkpointed` -1: all)."""
    from qwen_edit_core import speed
    n = len(transformer.transformer_blocks)
    offloaded = len(getattr(getattr(transformer, "_qwen_edit_offloader", None), "indices", []))
    ckpt = "-" if checkpointed is None else len(speed.checkpointed_indices(n, checkpointed))
    return f"fp8 {'on' if speed.has_fp8(transformer) else 'off'}, checkpointed {ckpt}/{n}, offloaded {offloaded}/{n}"


def _planned(config, transformer, bucket, budget_gb: float):
    """The planner's choice and estimate for this run, as `speed.configure_training` computes them."""
    from qwen_edit_core import speed
    from qwen_edit_core.train.distributed import sequence_tokens
    if budget_gb <= 0:
        return None
    tokens = sequence_tokens([bucket], config.model.variant, config.data.vl_area)  # as train.loop.setup plans
    no_fp8, no_offload = speed.base_limits(transformer)
    return speed.plan_for_budget(budget_gb, prefer_fp8=config.train.fp8_base, tokens=tokens,
                                 already_fp8=speed.has_fp8(transformer), no_fp8=no_fp8, no_offload=no_offload,
                                 **speed.model_sizes(transformer))


def _train_step(run, config, batch, scheduler_config: dict, mode) -> None:
    """`train.loop.micro_step`'s maths and `optimizer_step` on a collated batch (collate draws its dropout
    with `.item()`, which fake tensors cannot answer, so it runs before, on real CPU tensors)."""
    from qwen_edit_core import speed
    from qwen_edit_core.train import loop
    from qwen_edit_core.train.batch import flow_loss
    batch = fm.fake_batch(batch, mode)
    with torch.autocast(fm.STAND_IN.type, dtype=torch.bfloat16), speed.attention_kernel(config.train.attention):
        loss, _ = flow_loss(run.model, batch, config, scheduler_config)
        loss.backward()
    loop.optimizer_step(run)


def simulate_train(variant: str = variants.DEFAULT, side: int = 1024, controls: int | None = None,
                   budget_gb: float = 0.0, *, targets: str = "attn", fp8: bool = False,
                   num_layers: int | None = None, adapter: str = "lora") -> Simulated:
    """One steady-state training step (LoRA r16 on `targets`, or another `adapter` kind, bf16 autocast, AdamW)
    under the memory plan the product picks for `budget_gb` (0: every block checkpointed, no fp8, no offload)."""
    from qwen_edit_core.train import loop
    from qwen_edit_core.train.batch import collate
    from qwen_edit_core.train.distributed import image_tokens
    controls = fm.default_controls(variant) if controls is None else controls
    config, bucket, mode = _config(budget_gb, targets, fp8, variant, adapter), _bucket(side, controls), \
        fm.fake_mode(variant)
    model = fm.fake_transformer(variant, mode, lora=lora_spec(targets, variant, adapter), num_layers=num_layers)
    scheduler_config = dict(variants.get(variant).family.stage("tiny").SCHEDULER_CONFIG)
    plan = _planned(config, model, bucket, budget_gb)
    with tempfile.TemporaryDirectory() as out, mode:
        run = loop.setup(config, model, [bucket], Path(out), None, scheduler_config)
    _warm_optimizer(run, mode)
    item = fm.cache_item(variant, side, controls)
    batch = collate([item], [loop.sample_generator(0, 0, 0, 0)], caption_dropout=0.0, control_dropout=0.0,
                    device=fm.STAND_IN, dtype=torch.bfloat16, family=variants.get(variant).family)
    tracker, flops = fm.Tracker(), fm.GlobalFlops()
    tracker.track_external(model, run.optimizer)
    with mode, tracker, flops:
        _train_step(run, config, batch, scheduler_config, mode)
    name = f"train {budget_gb:g} GiB" if budget_gb else f"train no budget ({targets})"
    return _result(name if adapter == "lora" else f"{name}, {adapter}", "train", variant,
                   side, controls, image_tokens(bucket), fm.text_tokens(variant, side, controls), budget_gb or None,
                   plan.estimate.total / GIB if plan else None, tracker, flops, model,
                   plan.checkpoint_blocks if plan else -1)


def _result(plan, kind, variant, side, controls, n_image, n_text, budget, estimate, tracker, flops,
            model, checkpointed: int | None) -> Simulated:
    categories = tracker.peak_bytes()
    total = categories.get("Total", 0)
    return Simulated(plan=plan, kind=kind, variant=variant, size=side, controls=controls, image_tokens=n_image,
                     text_tokens=n_text, budget_gib=budget, planner_estimate_gib=estimate,
                     peak_device_gib=(total + margin_bytes(categories)) / GIB, tracked_device_gib=total / GIB,
                     peak_host_gib=host_bytes(model) / GIB,
                     flops_per_step=float(flops.get_total_flops()),
                     roofline_s=roofline_seconds(flops.get_flop_counts().get("Global", {})),
                     categories_gib={k: round(v / GIB, 3) for k, v in categories.items()},
                     offloaded_resident_after_gib=_offloaded_resident(model) / GIB,
                     levers=_levers_text(model, checkpointed),
                     reserved_gib=(total + margin_bytes(categories)) / GIB)


def _prompt(n_tokens: int, mode):
    from qwen_edit_core.model.encode import PromptEmbeds
    with mode:
        embeds = torch.empty(1, n_tokens, 3584, dtype=torch.bfloat16, device=fm.STAND_IN)
        mask = torch.ones(1, n_tokens, dtype=torch.long, device=fm.STAND_IN)
    return PromptEmbeds(embeds=embeds, mask=mask, lengths=(n_tokens,))


def _conditioning(variant: str, side: int, controls: int, mode, share: int = 1):
    """A true-CFG edit's conditioning (cond prompt, the " " negative with the same images, control latents);
    `share` > 1: one process's 1/share of every token sequence (context parallelism)."""
    Conditioning = variants.get(variant).family.stage("sampler").Conditioning
    n_text = fm.text_tokens(variant, side, controls)
    h, w = side // 16 // share, side // 16
    with mode:
        control = torch.empty(1, controls * h * w, 64, dtype=torch.bfloat16, device=fm.STAND_IN)
    return Conditioning(cond=_prompt(n_text // share, mode), uncond=_prompt((n_text - fm.CAPTION_TOKENS + 1) // share,
                                                                             mode),
                        control_tokens=control, img_shapes=[(1, h, w)] * (1 + controls), width=w * 16, height=h * 16)


def simulate_sample(variant: str = variants.DEFAULT, side: int = 1024, controls: int | None = None,
                    lever: str = "sequential", *, num_layers: int | None = None) -> Simulated:
    """One denoising step of a true-CFG edit (scale 4, negative " ") with a LoRA r16 loaded, through the
    sampler's own `denoise`, for one sampling lever (`SAMPLE_LEVERS`): "sequential" (cond then uncond),
    "fp8" (fp8 base, sequential), "batched" (both in one batch-2 call), "split" (one device's share of
    `cfg_mode: split`: one branch), "context-parallel-N" (one process's share: a forward over 1/N of the
    tokens; approximated, see docs/MEMORY.md)."""
    from qwen_edit_core import speed
    from qwen_edit_core.sample import sampler
    if lever not in SAMPLE_LEVERS:
        raise ValueError(f"sampling lever {lever!r} is not accepted; accepted: {', '.join(SAMPLE_LEVERS)}")
    if not fm.simulates_sampling(variant):
        raise ValueError(f"bench memory: the sampling levers are simulated for the 2025 variants; {variant!r} "
                         "samples with its prefix cache planned (`bench memory --sample`, bench/memory_sample.py)")
    controls = fm.default_controls(variant) if controls is None else controls
    mode = fm.fake_mode()
    model = fm.fake_transformer(variant, mode, lora=lora_spec("attn", variant), num_layers=num_layers)
    if lever == "fp8":
        with mode:
            speed.configure_inference(model, fm.STAND_IN, fp8=True, compile=False)
    share = int(lever.rsplit("-", 1)[1]) if lever.startswith("context-parallel") else 1
    cond = _conditioning(variant, side, controls, mode, share)
    settings = sampler.SampleSettings(num_inference_steps=1, cfg_mode="batched" if lever == "batched" else
                                      "sequential", true_cfg_scale=1.0 if lever == "split" else 4.0)
    tracker, flops = fm.Tracker(), fm.GlobalFlops()
    tracker.track_external(model)
    with mode, tracker, flops, torch.no_grad():
        # The guided velocity of one step, as `sampler.denoise` computes it (its scheduler reads tensor values
        # at construction, which fake tensors cannot answer; the Euler update itself is one latent-sized add).
        n_target = cond.img_shapes[0][1] * cond.img_shapes[0][2]
        latents = torch.empty(1, n_target, 64, dtype=torch.bfloat16, device=fm.STAND_IN)
        denoiser = sampler._Denoiser(model, cond, settings)
        denoiser(latents, torch.tensor(1000.0, device=fm.STAND_IN))
    n_image = (1 + controls) * (side // 16) ** 2
    return _result(f"sample {lever}", "sample", variant, side, controls, n_image,
                   fm.text_tokens(variant, side, controls), None, None, tracker, flops, model, None)


def run(variant: str = variants.DEFAULT, side: int = 1024, controls: int | None = None, budgets=BUDGETS, *,
        reference: bool = True, sample_levers=SAMPLE_LEVERS) -> list[Simulated]:
    """Every plan of one edit size: the training step of each budget's plan, the reference's setting (LoRA on the image
    attention, every block checkpointed, bf16: its measured peak is in BENCHMARKS.md, "Reference timings"), and one
    sampling step per sampling lever. Qwen-Image-2.1 (references: `controls`): the training step of each budget's plan
    only (its sampling: bench/memory_sample.py). Each row is announced in the log (stderr) before its minutes of CPU."""
    rows = [("train", b) for b in budgets]
    if fm.simulates_sampling(variant):
        rows += [("reference", None)] * reference + [("sample", lever) for lever in sample_levers]
    results = []
    for i, (kind, what) in enumerate(rows, 1):
        log.info("bench memory: row %d/%d: %s %d px x%s, %s", i, len(rows), variant, side,
                 controls if controls is not None else fm.default_controls(variant),
                 f"train, budget {what:g} GiB" if kind == "train" else "train, the reference's setting"
                 if kind == "reference" else f"sampling lever {what}")
        if kind == "train":
            results.append(simulate_train(variant, side, controls, what))
        elif kind == "reference":
            results.append(simulate_train(variant, side, controls, 0.0, targets="attn-img"))
        else:
            results.append(simulate_sample(variant, side, controls, what))
    return results


def _time_row(r: Simulated) -> str:
    """The roofline bound, the MFU of the reference's measured time (for the rows that match its setting:
    the no-budget attn-img step, the sequential CFG step) and the MFU our target time implies."""
    reference = REFERENCE_STEP_S if r.plan.endswith("(attn-img)") else \
        2 * REFERENCE_FORWARD_S if r.plan == "sample sequential" else None
    target = TARGET_TRAIN_S if r.kind == "train" else TARGET_SAMPLE_S
    measured = "-" if reference is None else f"{r.roofline_s / reference:.0%} at {reference:g} s"
    return f"{r.roofline_s:.2f} s | {measured} | {r.roofline_s / target:.0%} at {target:g} s"


def table(results: list[Simulated]) -> str:
    """The Markdown table BENCHMARKS.md and docs/MEMORY.md show."""
    lines = ["| plan | levers | tokens (image + text) | planner estimate | simulated peak (tracked + margin) | "
             "host | offloaded weights left on the device | TFLOP/step | H100 roofline | MFU of the "
             "measured reference | MFU of the target |", "|" + " --- |" * 11]
    for r in results:
        estimate = "-" if r.planner_estimate_gib is None else f"{r.planner_estimate_gib:.1f} GiB"
        lines.append(f"| {r.variant} {r.size}² x{r.controls}, {r.plan} | {r.levers} | {r.image_tokens} + "
                     f"{r.text_tokens} | {estimate} | {r.peak_device_gib:.1f} GiB ({r.tracked_device_gib:.1f} + "
                     f"{r.peak_device_gib - r.tracked_device_gib:.1f}) | {r.peak_host_gib:.1f} GiB | "
                     f"{r.offloaded_resident_after_gib:.1f} GiB | {r.flops_per_step / 1e12:.0f} | {_time_row(r)} |")
    return "\n".join(lines)


def check_edit(variant: str, side: int, controls: int | None) -> None:
    """ValueError naming `--size` or `--controls` when the simulated edit is outside what the model takes: a side
    from 64 px (a multiple of 16 once rounded) to the image limit, 1 control image up to the variant's most."""
    from qwen_edit_core.model.geometry import MAX_PIXELS, MIN_SIDE
    if not MIN_SIDE <= side <= int(MAX_PIXELS ** 0.5):
        raise ValueError(f"--size {side}: the edit's side must be in [{MIN_SIDE}, {int(MAX_PIXELS ** 0.5)}] px")
    most = variants.get(variant).max_controls
    if controls is not None and (controls < 1 or most is not None and controls > most):
        raise ValueError(f"--controls {controls}: variant {variant!r} takes 1 to {most or 'any number of'} control "
                         "images")


def report(variant: str = variants.DEFAULT, side: int = 1024, controls: int | None = None,
           budget_gb: float | None = None, *, as_json: bool = False, adapter: str = "lora") -> str:
    """`qwen-edit bench memory`'s output: the table, or one JSON object per line (`as_json`). `budget_gb`: that
    budget's training row only; `adapter` other than "lora": that budget's row training that adapter kind."""
    if adapter != "lora":
        if budget_gb is None:
            raise ValueError(f"bench memory --adapter {adapter}: give the row's --budget-gb")
        return render([simulate_train(variant, side, controls, budget_gb, adapter=adapter)], as_json)
    results = run(variant, side, controls, BUDGETS) if budget_gb is None else \
        run(variant, side, controls, (budget_gb,), reference=False, sample_levers=())
    return render(results, as_json)


def render(results: list[Simulated], as_json: bool) -> str:
    """The table, or one JSON object per line (`as_json`)."""
    return "\n".join(r.to_json() for r in results) if as_json else table(results)
