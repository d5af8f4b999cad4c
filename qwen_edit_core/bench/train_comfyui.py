"""The runbook's ComfyUI 24 GiB measurement (`device_run.sh comfyui24`): the Train node's job as
bench/memory_comfyui.py simulates it (the graph's model from the scaled-fp8 file, lent to the job, LoRA r16 on
`attn`, checkpointing, bf16 autocast, the node's budget for the card), on a CUDA device capped to a `card_gib`
card (`torch.cuda.set_per_process_memory_fraction`), its reserved peak and pinned host bytes printed beside the
simulated row's. The weights are random (bench/common.py `real_transformer`): memory does not depend on them."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch


def run(device: str = "cuda:0", steps: int = 4, card_gib: float = 24.0) -> str:
    """Measure the node's job on a `card_gib` card and return the printed table (measured vs simulated)."""
    from qwen_edit_core import speed
    from qwen_edit_core.adapters import lora
    from qwen_edit_core.bench import memory, memory_comfyui
    from qwen_edit_core.bench import train as bench_train
    from qwen_edit_core.bench.common import gib_text, peak_gib, pinned_gib, print_table, reserved_gib
    from qwen_edit_core.config import load_config
    from qwen_edit_core.data.examples import EditExample
    from qwen_edit_core.train.loop import train
    dev = torch.device(device)
    graph = bench_train._build(dev, torch.bfloat16)
    speed.quantize_fp8(graph)  # the scaled-fp8 file's block linears, kept in fp8 by the loader
    torch.cuda.empty_cache()
    # the card: what the fp8 graph model holds now counts against it, as on a real 24 GB card
    torch.cuda.set_per_process_memory_fraction(min(1.0, card_gib * 2**30 / torch.cuda.get_device_properties(dev)
                                                   .total_memory), dev)
    lent = speed.lend(graph)
    lora.inject_lora(lent, memory.lora_spec(memory_comfyui.NODE_TARGETS))
    work = Path(tempfile.mkdtemp(prefix="qwen-edit-bench-comfyui-"))
    config = load_config(overrides={"train": {"output_dir": str(work), "max_steps": steps, "device": str(dev),
                                              "mixed_precision": "bf16", "gradient_checkpointing": True,
                                              "memory_budget_gb": memory_comfyui.node_budget_gb(card_gib)},
                                    "optimizer": {"lr": 1e-30}, "logging": {"plot": False}})
    side = 1024
    item = bench_train.real_item(side=side)
    example = EditExample(name="random", target=Path("random.png"), controls=(Path("random-control.png"),),
                          caption="", target_size=(side, side), control_sizes=((side, side),))
    try:
        times = bench_train._step_times(lambda p: train(config, lent, lambda i: item, [example],
                                                        [((side, side), ((side, side),))],
                                                        scheduler_config={"max_image_seq_len": 8192, "max_shift": 0.9},
                                                        write_lora=lambda path, step: None, out_dir=work, progress=p),
                                        dev)[0]
        measured = [reserved_gib(dev), peak_gib(dev), pinned_gib(dev)]
    finally:
        speed.give_back(lent)
    sim = memory_comfyui.simulate_comfyui(card_gib=card_gib)
    rows = [["measured (GPU)", gib_text(measured[0]), gib_text(measured[1]), gib_text(measured[2]),
             f"{sum(times) / max(len(times), 1):.2f}"],
            ["simulated", f"{sim.reserved_gib:.1f}", f"{sim.tracked_device_gib:.1f}", f"{sim.peak_host_gib:.1f}", "-"]]
    return print_table(f"ComfyUI Train node job, fp8 file, {card_gib:g} GiB card (node budget "
                       f"{memory_comfyui.node_budget_gb(card_gib):.1f} GiB), 1024^2 Edit",
                       ["", "reserved GiB", "allocated peak GiB", "pinned host GiB", "s/step"], rows)
