"""How many intra-op threads torch uses for CPU work, chosen once for the CLI, the demo and ComfyUI jobs.

Why: on a small or busy machine, torch's default (one thread per core) makes every small operation end in a
barrier that waits for all its threads, and a thread the OS has descheduled holds the operation up; the toy
model's training step ran several times slower that way (`qwen-edit bench threads` measures the ratio on the
machine at hand). On a GPU the thread count hardly matters: the CPU only launches kernels.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch

#: at or below this many cores, CPU work runs on one thread by default
SMALL_MACHINE_CORES = 4


def default_threads(cores: Optional[int] = None, load: Optional[float] = None) -> int:
    """The thread count used when the user sets none: 1 on a machine of at most `SMALL_MACHINE_CORES` cores or
    one whose 1-minute load average is at least its core count minus one; otherwise the cores left free by the
    load (at least 1). `cores` and `load` default to this machine's."""
    cores = cores if cores is not None else (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                             else os.cpu_count() or 1)
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if cores <= SMALL_MACHINE_CORES or load >= cores - 1:
        return 1
    return max(1, int(cores - load))


def checked_threads(threads: Optional[int]) -> int:
    """`threads` if it is a positive count, `default_threads()` for None or 0 ("auto"); refuses a negative one."""
    if threads is None or threads == 0:
        return default_threads()
    if threads < 0:
        raise ValueError(f"threads={threads}: give a positive count of CPU threads, or 0 to choose from the cores")
    return int(threads)


@contextlib.contextmanager
def torch_threads(threads: Optional[int]) -> Iterator[int]:
    """torch's intra-op thread count set to `checked_threads(threads)` inside the block, restored after; yields
    the count used."""
    count = checked_threads(threads)
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield count
    finally:
        torch.set_num_threads(before)
