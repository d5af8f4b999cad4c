"""The cache stage shared out over the processes of one launch.

On a fresh cache every process of an `accelerate launch` / `torchrun` run needs every entry. Rather than each
process encoding all of them into the same folder, process r encodes every N-th missing entry (r, r + N, ...)
and all wait for the others before training starts, so N processes fill the cache in about 1/N of the time.
The entries are those one process writes (each is keyed by its example, not by who computed it), and the cache
writes each entry under a temporary name and renames it, so processes never see each other's partial files.

The wait is one all-reduce of a failure flag: a process whose share failed still joins it, so the others stop
with a message instead of waiting for the collective timeout.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Sequence, TypeVar

import torch

log = logging.getLogger(__name__)

T = TypeVar("T")


def launch_world() -> int:
    """The number of processes of this launch (1 outside a multi-process launcher): `WORLD_SIZE`, which torchrun
    and every multi-process `accelerate launch` set."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def share_of(items: Sequence[T], rank: int, world: int) -> list[T]:
    """Process `rank`'s share of `items` among `world` processes: every `world`-th item from `rank`, so the
    shares are disjoint, cover every item and differ in size by at most one."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"process {rank} of {world}: the rank must be in 0..{world - 1} and the world at least 1")
    return list(items[rank::world])


def run_shared(missing: Sequence[T], encode: Callable[[list[T]], dict], *, cpu: bool) -> dict:
    """Encode this process's share of `missing` with `encode(share)` (which returns build_cache's counts), then wait
    until every process has finished its share. Returns this process's counts with "total" set to the whole stage's.
    Every process calls it, also with nothing missing: the first wait keeps an early process's writes out of a later
    process's list of what is missing. Raises RuntimeError on every process when any process's share failed."""
    from accelerate import PartialState

    from qwen_edit_core.train.distributed import COLLECTIVE_TIMEOUT
    state = PartialState(cpu=cpu, timeout=COLLECTIVE_TIMEOUT)  # the process group the trainer then reuses
    # every process has listed what is missing before any writes, so all hold the same list and shares
    state.wait_for_everyone()
    share = share_of(missing, state.process_index, state.num_processes)
    log.info("cache: process %d of %d encodes %d of the %d missing entries", state.process_index,
             state.num_processes, len(share), len(missing))
    failed, counts, error = 0.0, {"total": len(share), "hits": 0, "computed": 0}, None
    try:
        if share:
            counts = encode(share)
    except BaseException as exc:  # joined below first, so the others are told instead of left waiting
        failed, error = 1.0, exc
    flag = torch.tensor([failed], device=state.device)
    torch.distributed.all_reduce(flag)
    if error is not None:
        raise error
    if flag.item() > 0:
        raise RuntimeError("the cache stage stopped: another process of this launch failed while encoding its "
                           "share of the cache (its log says why); fix that and start the run again, the entries "
                           "already written are kept")
    return {**counts, "total": len(missing)}
