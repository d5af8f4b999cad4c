"""`qwen-edit bench doctor`: the dataset doctor over 10,000 small synthetic pairs (64 px, the planted-fault
dataset's 24 pairs and clean ones after them) as `qwen-edit doctor` runs it: the dataset reader validates each
picture and the doctor measures it from that one decode, cold (every pair measured) and warm (the measures from the
cache); the reader alone beside them for scale. Pairs per second, CPU seconds and the load average.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

from qwen_edit_core.data.dataset import load_dataset
from qwen_edit_core.data.doctor import DoctorSettings, diagnose
from qwen_edit_core.data.doctor.faulty import score, write_faulty_dataset
from qwen_edit_core.data.doctor.runner import PairMeasurer, default_workers

log = logging.getLogger(__name__)

PAIRS = 10_000
SIDE = 64


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (the workers): on a busy machine the wall time measures
    the other jobs as much as the doctor."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def run(pairs: int = PAIRS, workers: int | None = None) -> dict:
    """Write `pairs` pairs (and the 2 held-out ones), time the reader alone, then reader and doctor (cold, warm);
    prints and returns pairs/s, with the CPU seconds (workers included) and the recall and precision on the planted
    faults."""
    workers = workers or default_workers()
    with tempfile.TemporaryDirectory(prefix="doctor-bench-") as tmp:
        start = time.perf_counter()
        dataset = write_faulty_dataset(Path(tmp) / "data", size=SIDE, count=pairs)
        log.info("wrote %d pairs in %.1f s", pairs, time.perf_counter() - start)
        start, start_cpu = time.perf_counter(), _cpu_seconds()
        load_dataset(dataset.train)
        rates = {"dataset reader alone": pairs / (time.perf_counter() - start)}
        cpu = {"dataset reader alone": _cpu_seconds() - start_cpu}
        for label in ("reader + doctor, cold", "reader + doctor, warm"):
            start, start_cpu = time.perf_counter(), _cpu_seconds()
            with PairMeasurer(Path(tmp) / "cache", workers) as measured:
                examples = load_dataset(dataset.train, on_pair=measured).examples
                held = load_dataset(dataset.heldout, on_pair=measured).examples
                report = diagnose(examples, held, DoctorSettings(), workers=workers, measured=measured)
            rates[label] = pairs / (time.perf_counter() - start)
            cpu[label] = _cpu_seconds() - start_cpu
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    recall, precision = score(report, dataset)
    kinds = Counter(f.kind for f in report.findings)
    flagged = ", ".join(f"{n} {k}" for k, n in kinds.items())
    print(f"{pairs} pairs of {SIDE} px, {workers} worker process(es), {os.cpu_count()} CPUs, "  # noqa: T201
          f"load average {load:.1f} at the end; {len(report.flagged)} flagged ({flagged}"
          f"): recall of the planted faults {recall:.0%}, precision {precision:.0%}")
    for label, rate in rates.items():
        used = f", {cpu[label]:.1f} CPU s: {pairs / cpu[label]:.0f} pairs per CPU second"
        print(f"  {label:22s} {rate:8.0f} pairs/s  ({pairs / rate:5.1f} s{used}, "  # noqa: T201
              f"{1000 * cpu[label] / pairs:.2f} CPU ms a pair)")
    return rates
