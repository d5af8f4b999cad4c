"""`qwen-edit bench memory --comfyui`: the Train node's job at real size, simulated as bench.memory simulates the
command line's, on the path a ComfyUI user takes.

The graph's model is what the pack's loader node leaves on the GPU: with Comfy-Org's scaled-fp8 file
(`--file-dtype fp8`, the only form of the 20 B model that fits a 24 GB card) the block linears stay in fp8
(`speed.Fp8Linear`, as model/single_file.py keeps them). The job trains on a lent copy (`speed.lend`, as
`train.run.fit(shared=...)` does), with the node's defaults: LoRA rank 16 on `attn`, gradient checkpointing on,
bf16 autocast, and a memory budget of 90% of the memory the card has free plus the model's own weights there
(`planner.free_memory_budget_gb`, `train.memory_budget_auto`). Blocks the plan offloads take the lender's device
tensors with them (speed.lending), so the tracked peak counts only what stays.

With the bf16 file (`--file-dtype bf16`; ComfyUI keeps part of a model that does not fit its card in host memory,
the simulator starts from the whole of it on the device) an fp8 plan parks the lender's bf16 linears in pageable
host memory as the copy's fp8 layers replace them. `speed.lending` parks nothing that is already on the CPU, which
the stand-in device is (bench.fake_model), so the simulator moves them itself (`_park_on_stand_in`) before the
step is tracked; the row's host memory adds them to the pinned region (bench.memory `host_bytes`).
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from pathlib import Path

import torch

from qwen_edit_core.bench import fake_model as fm
from qwen_edit_core.bench import memory
from qwen_edit_core.families import variants

log = logging.getLogger(__name__)

#: the Train node's default LoRA targets (the first preset of its `targets` input)
NODE_TARGETS = "attn"
FILE_DTYPES = ("fp8", "bf16")


def node_budget_gb(card_gib: float) -> float:
    """The budget the Train node plans with on an empty card of `card_gib` GiB holding the graph's model: 90% of
    its free memory plus the model's weights there; the CUDA context (planner.MARGIN_FIXED) is not free."""
    from qwen_edit_core.speed import planner
    return planner.free_memory_budget_gb(int(card_gib * memory.GIB) - planner.MARGIN_FIXED, 0)


def simulate_comfyui(variant: str = variants.DEFAULT, side: int = 1024, controls: int | None = None,
                     card_gib: float = 24.0,
                     *, file_dtype: str = "fp8", num_layers: int | None = None) -> memory.Simulated:
    """One steady-state training step of the Train node's job on a `card_gib` card (module doc)."""
    from qwen_edit_core import speed
    from qwen_edit_core.train import loop
    from qwen_edit_core.train.batch import collate
    from qwen_edit_core.train.distributed import image_tokens
    if file_dtype not in FILE_DTYPES:
        raise ValueError(f"bench memory --comfyui: --file-dtype {file_dtype!r} is not accepted; accepted: "
                         f"{', '.join(FILE_DTYPES)}")
    if variants.get(variant).family is not variants.get(variants.DEFAULT).family:
        raise ValueError(f"bench memory --comfyui: {variant!r} has no ComfyUI training path simulated; use a variant "
                         f"of the {variants.DEFAULT!r} family")
    controls = fm.default_controls(variant) if controls is None else controls
    budget = node_budget_gb(card_gib)
    config, bucket, mode = memory._config(budget, NODE_TARGETS, False, variant), memory._bucket(side, controls), \
        fm.fake_mode(variant)
    graph_model = fm.fake_transformer(variant, mode, lora=memory.lora_spec(NODE_TARGETS, variant),
                                      num_layers=num_layers)
    if file_dtype == "fp8":
        with mode:
            speed.quantize_fp8(graph_model)  # the scaled-fp8 file's linears, kept in fp8 by the loader
    model = speed.lend(graph_model)
    scheduler_config = dict(variants.get(variant).family.stage("tiny").SCHEDULER_CONFIG)
    plan = memory._planned(config, model, bucket, budget)
    with tempfile.TemporaryDirectory() as out, mode:
        run = loop.setup(config, model, [bucket], Path(out), None, scheduler_config)
    parked = _park_on_stand_in(graph_model, model, mode)
    memory._warm_optimizer(run, mode)
    item = fm.cache_item(variant, side, controls)
    batch = collate([item], [loop.sample_generator(0, 0, 0, 0)], caption_dropout=0.0, control_dropout=0.0,
                    device=fm.STAND_IN, dtype=torch.bfloat16, family=variants.get(variant).family)
    tracker, flops = fm.Tracker(), fm.GlobalFlops()
    tracker.track_external(graph_model, model, run.optimizer)
    with mode, tracker, flops:
        memory._train_step(run, config, batch, scheduler_config, mode)
    result = memory._result(f"comfyui {file_dtype} file, {card_gib:g} GiB card", "train", variant, side, controls,
                            image_tokens(bucket), fm.text_tokens(variant, side, controls), card_gib,
                            plan.estimate.total / memory.GIB if plan else None, tracker, flops, model,
                            plan.checkpoint_blocks if plan else -1)
    return dataclasses.replace(result, peak_host_gib=result.peak_host_gib + parked / memory.GIB)


def _park_on_stand_in(graph_model, model, mode) -> int:
    """What `speed.lending.park` does on a GPU and skips on the stand-in device (the CPU, which is host memory to
    it): each of the lender's weights the lent copy no longer uses (a bf16 linear its fp8 layer replaced) leaves
    the device, its tensor object emptied. Returns the bytes moved to host memory."""
    used = {id(t) for t in (*model.parameters(), *model.buffers())}
    moved = 0
    with mode:
        for tensor in graph_model.parameters():
            if id(tensor) not in used and tensor.numel():
                moved += tensor.numel() * tensor.element_size()
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return moved


def report(variant: str = variants.DEFAULT, side: int = 1024, controls: int | None = None,
           card_gib: float | None = None, *,
           file_dtype: str = "fp8", as_json: bool = False) -> str:
    """`qwen-edit bench memory --comfyui`'s output: the node's job on a `card_gib` card (default 24 GiB)."""
    log.info("bench memory --comfyui: %s %d px x%s, %s file, %g GiB card", variant, side,
             controls if controls is not None else fm.default_controls(variant), file_dtype, card_gib or 24.0)
    return memory.render([simulate_comfyui(variant, side, controls, card_gib or 24.0, file_dtype=file_dtype)],
                         as_json)
