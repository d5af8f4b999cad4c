"""`qwen-edit bench threads`: one toy-model training step (the demo's LoRA step) on 1 intra-op thread against
torch's default thread count, in the same process.

Why: the toy model's operations take microseconds, so with several threads every operation ends in a
barrier that waits for all of them; when the machine is busy, a thread that the OS has descheduled holds
every operation up. The demo therefore runs on one thread (demo.py `one_thread`). Run it on a quiet machine
and again while the cores are busy: the ratio is the demo's slowdown that the thread count explains.
"""

from __future__ import annotations

import logging
import os

import torch

from qwen_edit_core.bench.common import median_time

log = logging.getLogger(__name__)


def _step(transformer, batch: int, tokens: int):
    """A closure running forward + backward of the toy transformer on a demo-sized batch (128 px: 64 target
    and 64 control tokens, 12 text tokens)."""
    side = int(tokens ** 0.5)
    hidden = torch.randn(batch, 2 * tokens, 64)
    text = torch.randn(batch, 12, 32)
    timestep = torch.rand(batch)

    def run():
        out = transformer(hidden_states=hidden, timestep=timestep, encoder_hidden_states=text,
                          img_shapes=[[(1, side, side), (1, side, side)]] * batch, return_dict=False)[0]
        out[:, :tokens].square().mean().backward()
    return run


def run(repeats: int = 5, batch: int = 8) -> dict:
    """Time the step at 1 thread and at torch's default; prints and returns {threads: seconds}."""
    from qwen_edit_core.families import DEFAULT
    from qwen_edit_core.toys.pretrain import Recipe, transformer_settings

    default = torch.get_num_threads()
    torch.manual_seed(0)
    transformer = DEFAULT.class_of("transformer")(**transformer_settings(Recipe()))
    step = _step(transformer, batch, 64)
    times = {}
    try:
        for threads in sorted({1, default}):
            torch.set_num_threads(threads)
            times[threads] = median_time(step, torch.device("cpu"), repeats)
    finally:
        torch.set_num_threads(default)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    for threads, seconds in times.items():
        log.info("toy LoRA-sized step, %d thread(s): %.4f s (%.2fx the 1-thread time); load average %.1f, %d cores",
                 threads, seconds, seconds / times[1], load, os.cpu_count() or 0)
    return times
