"""`qwen-edit bench doctor`: the dataset doctor over 10,000 small synthetic pairs (64 px, the planted-fault
dataset's 24 pairs and clean ones after them): pairs per second measured cold (every picture read, hashed and
measured, in worker processes) and warm (read and hashed, the measures from the cache), and the dataset reader's
own validation beside them for scale."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

from qwen_edit_core.data.dataset import load_dataset
from qwen_edit_core.data.doctor import DoctorSettings, diagnose
from qwen_edit_core.data.doctor.faulty import write_faulty_dataset
from qwen_edit_core.data.doctor.runner import default_workers

log = logging.getLogger(__name__)

PAIRS = 10_000
SIDE = 64


def run(pairs: int = PAIRS, workers: int | None = None) -> dict:
    """Write `pairs` pairs, time the reader and the doctor (cold, then warm); prints and returns pairs/s."""
    workers = workers or default_workers()
    with tempfile.TemporaryDirectory(prefix="doctor-bench-") as tmp:
        start = time.perf_counter()
        dataset = write_faulty_dataset(Path(tmp) / "data", size=SIDE, count=pairs)
        log.info("wrote %d pairs in %.1f s", pairs, time.perf_counter() - start)
        start = time.perf_counter()
        examples = load_dataset(dataset.train).examples
        read = time.perf_counter() - start
        rates = {"dataset reader": pairs / read}
        for label in ("doctor, cold", "doctor, warm (cache)"):
            start = time.perf_counter()
            report = diagnose(examples, (), DoctorSettings(), cache_dir=Path(tmp) / "cache", workers=workers)
            rates[label] = pairs / (time.perf_counter() - start)
    print(f"{pairs} pairs of {SIDE} px, {workers} worker process(es); {len(report.flagged)} flagged")  # noqa: T201
    for label, rate in rates.items():
        print(f"  {label:22s} {rate:8.0f} pairs/s  ({pairs / rate:5.1f} s)")  # noqa: T201
    return rates
