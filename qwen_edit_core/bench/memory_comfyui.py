"""`qwen-edit bench memory --comfyui`: the Train node's job at real size, simulated as bench.memory simulates the
command line's, on the path a ComfyUI user takes.

The graph's model is what the pack's loader node leaves on the GPU: with Comfy-Org's scaled-fp8 file
(`--file-dtype fp8`, the only form of the 20 B model that fits a 24 GB card) the block linears stay in fp8
(`speed.Fp8Linear`, as model/single_file.py keeps them). The job trains on a lent copy (`speed.lend`, as
`train.run.fit(shared=...)` does), with the node's defaults: LoRA rank 16 on `attn`, gradient checkpointing on,
bf16 autocast, and a memory budget of 90% of the memory the card has free plus the model's own weights there
(`planner.free_memory_budget_gb`, `train.memory_budget_auto`). Blocks the plan offloads take the lender's device
tensors with them (speed.lending), so the tracked peak counts only what stays.

A bf16 file under an fp8 plan parks the lender's bf16 linears in host memory; the simulator's stand-in device is
the CPU itself (bench.fake_model), where host and device cannot be told apart, so that path is not simulated.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from qwen_edit_core.bench import fake_model as fm
from qwen_edit_core.bench import memory
from qwen_edit_core.families import variants

#: the Train node's default LoRA targets (the first preset of its `targets` input)
NODE_TARGETS = "attn"
FILE_DTYPES = ("fp8", "bf16")


def node_budget_gb(card_gib: float) -> float:
    """The budget the Train node plans with on an empty card of `card_gib` GiB holding the graph's model: 90% of
    its free memory plus the model's weights there; the CUDA context (planner.MARGIN_FIXED) is not free."""
    from qwen_edit_core.speed import planner
    return planner.free_memory_budget_gb(int(card_gib * memory.GIB) - planner.MARGIN_FIXED, 0)


def simulate_comfyui(variant: str = variants.DEFAULT, side: int = 1024, controls: int | None = None, card_gib: float = 24.0,
                     *, file_dtype: str = "fp8", num_layers: int | None = None) -> memory.Simulated:
    """One steady-state training step of the Train node's job on a `card_gib` card (module doc)."""
    from qwen_edit_core import speed
    from qwen_edit_core.train import loop
    from qwen_edit_core.train.batch import collate
    from qwen_edit_core.train.distributed import image_tokens
    if file_dtype != "fp8":
        raise ValueError(f"bench memory --comfyui: --file-dtype {file_dtype!r} is not simulated (its parked bf16 "
                         "weights live in host memory, which the stand-in device cannot tell apart); use fp8")
    if variants.get(variant).family is not variants.get(variants.DEFAULT).family:
        raise ValueError(f"bench memory --comfyui: {variant!r} has no ComfyUI training path simulated; use a variant "
                         f"of the {variants.DEFAULT!r} family")
    controls = fm.default_controls(variant) if controls is None else controls
    budget = node_budget_gb(card_gib)
    config, bucket, mode = memory._config(budget, NODE_TARGETS, False, variant), memory._bucket(side, controls), \
        fm.fake_mode(variant)
    graph_model = fm.fake_transformer(variant, mode, lora=memory.lora_spec(NODE_TARGETS, variant),
                                      num_layers=num_layers)
    with mode:
        speed.quantize_fp8(graph_model)  # the scaled-fp8 file's linears, kept in fp8 by the loader
    model = speed.lend(graph_model)
    scheduler_config = dict(variants.get(variant).family.stage("tiny").SCHEDULER_CONFIG)
    plan = memory._planned(config, model, bucket, budget)
    with tempfile.TemporaryDirectory() as out, mode:
        run = loop.setup(config, model, [bucket], Path(out), None, scheduler_config)
    memory._warm_optimizer(run, mode)
    item = fm.cache_item(variant, side, controls)
    batch = collate([item], [loop.sample_generator(0, 0, 0, 0)], caption_dropout=0.0, control_dropout=0.0,
                    device=fm.STAND_IN, dtype=torch.bfloat16, family=variants.get(variant).family)
    tracker, flops = fm.Tracker(), fm.GlobalFlops()
    tracker.track_external(graph_model, model, run.optimizer)
    with mode, tracker, flops:
        memory._train_step(run, config, batch, scheduler_config, mode)
    return memory._result(f"comfyui {file_dtype} file, {card_gib:g} GiB card", "train", variant, side, controls,
                          image_tokens(bucket), fm.text_tokens(variant, side, controls), card_gib,
                          plan.estimate.total / memory.GIB if plan else None, tracker, flops, model,
                          plan.checkpoint_blocks if plan else -1)


def report(variant: str = variants.DEFAULT, side: int = 1024, controls: int | None = None, card_gib: float | None = None, *,
           file_dtype: str = "fp8", as_json: bool = False) -> str:
    """`qwen-edit bench memory --comfyui`'s output: the node's job on a `card_gib` card (default 24 GiB)."""
    return memory.render([simulate_comfyui(variant, side, controls, card_gib or 24.0, file_dtype=file_dtype)],
                         as_json)
