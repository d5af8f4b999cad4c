"""The cache stage shared over the processes of a launch: the shares, and a failing process stopping the others.
The equality of a two-process cache with a one-process cache is in test_training.py's accelerate test."""
import os
import socket
import subprocess
import sys

import pytest

from qwen_edit_core.train.cache_share import share_of


def test_shares_are_disjoint_cover_everything_and_balanced():
    items = list(range(11))
    for world in (1, 2, 3, 4, 16):
        shares = [share_of(items, rank, world) for rank in range(world)]
        assert sorted(x for share in shares for x in share) == items
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert share_of(items, 1, 4) == [1, 5, 9]


def test_a_rank_outside_the_world_is_refused():
    with pytest.raises(ValueError, match="process 2 of 2"):
        share_of([1, 2], 2, 2)


_WORKER = """
import os, sys
from qwen_edit_core.train.cache_share import run_shared
rank = int(os.environ["RANK"])
def encode(share):
    if rank == 1:
        raise OSError("encoder failed on purpose")
    return {"total": len(share), "hits": 0, "computed": len(share)}
try:
    run_shared(list(range(5)), encode, cpu=True)
except BaseException as exc:
    print(f"rank {rank}: {type(exc).__name__}: {exc}")
    sys.exit(3)
print(f"rank {rank}: finished")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two processes with a gloo process group
def test_a_failing_process_stops_the_others_with_a_message(tmp_path):
    """Process 1's encoder raises: it reports its own error, and process 0, whose share went well, stops at the
    wait with a message pointing at the other process instead of training on a partial cache."""
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [3, 3], outs
    assert "rank 1: OSError: encoder failed on purpose" in outs[1]
    assert "rank 0: RuntimeError: the cache stage stopped: another process of this launch failed" in outs[0]
