"""The training bench's budget rows as users run them: the transformer loaded through the planned loader in a
fresh process.

A budget row measured in the bench's own process would start from the whole bf16 transformer built on the device
(about 42 GiB reserved before any lever shrinks it), which a 16 GiB card never holds. Here a new Python process
makes the plan first (`speed.plan_training` on the model's meta-device sizes, as train/run.py `training_plan`
does), streams the weights straight into it (model/planned_load.py `load_transformer_planned`: fp8 where planned,
offloaded blocks in one pinned host region), then trains as the product does (train.loop.train). It prints one
JSON line: median step seconds, allocated and reserved peaks, pinned host bytes, the fixed-batch loss, the
attention kernels and the CUDA kernels with the largest share of one whole training step.

Weights: bench/random_weights.py `RandomSource`, the same numbers as the bench's other rows.
"""

from __future__ import annotations

import json
import logging
import sys

import torch

from qwen_edit_core.bench import train as bench_train

log = logging.getLogger(__name__)


def planned_row(device: str, steps: int, overrides: dict, *, text_tokens: int, side: int,
                layers: int | None = None) -> dict:
    """One budget row in this process (module doc): plan, planned load, `steps` training steps."""
    from qwen_edit_core import speed
    from qwen_edit_core.adapters import lora
    from qwen_edit_core.bench.common import pinned_gib, reserved_gib
    from qwen_edit_core.bench.random_weights import random_source, random_transformer
    from qwen_edit_core.train.distributed import sequence_tokens
    from qwen_edit_core.train.run import planned_sizes
    from qwen_edit_core.bench.common import bench_dtype
    dev = torch.device(device)
    dtype = bench_dtype(dev)
    spec = lora.LoraSpec(rank=16, alpha=16, targets=lora.TARGET_PRESETS["attn-img"])
    config = bench_train.bench_config(dev, steps, overrides)
    source = random_source(dtype, dev, layers)  # planned on shapes alone: nothing drawn yet
    available = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else None
    keys = [((side, side), ((side, side),))]
    plan = speed.plan_training(config.train, dev, dtype, planned_sizes(source, spec),
                               sequence_tokens(keys, config.model.variant, config.data.vl_area), available=available)
    log.info("planned row: %s", plan)
    model = random_transformer(dev, dtype, plan, num_layers=layers)
    item = bench_train.real_item(text_tokens=text_tokens, side=side, dtype=dtype)
    out = bench_train.train_row(model, dev, dtype, steps, item, config, profile_last=True)
    out["pinned"] = pinned_gib(dev)
    out["reserved"] = reserved_gib(dev)
    return out


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    out = planned_row(**json.loads(argv[0]))
    sys.stdout.write(bench_train.PLANNED_RESULT + json.dumps(out) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
