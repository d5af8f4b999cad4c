"""`qwen-edit bench cache`: the cache stage on one process against N processes of one launch, on the CPU.

Each row runs `qwen-edit cache` on a fresh cache of synthetic pairs with the tiny model under torchrun
(`--nproc_per_node 1` or N, one thread per process), then once more on the complete cache: that second run
is the start-up (imports, model config, the check of every entry) the stage does not depend on, and the
difference is the encoding time the processes share. The ratio compares the two differences, measured in the
same call, so a busy machine slows both alike. With N processes on at least N free cores the ratio is about
1/N plus the one wait at the end.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cache_seconds(config: Path, processes: int) -> float:
    """Wall seconds of `qwen-edit cache CONFIG` under torchrun with `processes` CPU processes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(processes),
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), "-m", "qwen_edit_core.cli", "cache",
           str(config)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"bench cache: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def run(pairs: int = 200, processes: int = 2, side: int = 64) -> dict:
    """Time the cache stage of `pairs` synthetic pairs (`side` px) on 1 and on `processes` processes; logs and
    returns {processes: encoding seconds}."""
    import yaml

    from qwen_edit_core.data.synthetic import write_pairs
    from qwen_edit_core.model.tiny import build_tiny

    times = {}
    with tempfile.TemporaryDirectory(prefix="qwen-edit-bench-cache-") as tmp:
        root = Path(tmp)
        model = build_tiny(root / "model")
        write_pairs(root / "pairs", pairs, seed=0, size=side)
        for n in (1, processes):
            config = root / f"cache-{n}.yaml"
            config.write_text(yaml.safe_dump({
                "model": {"pretrained_model_name_or_path": str(model)},
                "data": {"folder": str(root / "pairs"), "vae_area": side * side},
                "cache": {"dir": str(root / f"cache-{n}")},
                "train": {"output_dir": str(root / f"out-{n}"), "device": "cpu"}}))
            fresh = _cache_seconds(config, n)
            startup = _cache_seconds(config, n)  # every entry present: start-up and the check only
            times[n] = max(fresh - startup, 0.0)
            log.info("cache stage, %d pairs of %d px, %d process(es): %.1f s encoding (%.1f s with start-up)",
                     pairs, side, n, times[n], fresh)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    log.info("%d processes take %.2fx the time of one (load average %.1f, %d cores)", processes,
             times[processes] / times[1] if times[1] else float("nan"), load, os.cpu_count() or 0)
    return times
