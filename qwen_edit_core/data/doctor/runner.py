"""Running the doctor: read every pair once, measure it (or take its measures from the cache by the content hashes
of its files), run every check family, and collect the findings worst first."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from qwen_edit_core.common.files import write_bytes
from qwen_edit_core.data.doctor import alignment, captions, duplicates, references, regions, sizes, swapped
from qwen_edit_core.data.doctor.findings import DoctorReport, DoctorSettings, Finding, Measured
from qwen_edit_core.data.doctor.measure import VERSION, Measures, measure
from qwen_edit_core.data.doctor.pictures import ANALYSIS_SIDE, PairPictures, decode, read_bytes
from qwen_edit_core.data.examples import EditExample
from qwen_edit_core.data.doctor.fixes import apply_fixes
from qwen_edit_core.data.doctor.look import html_path, write_report

log = logging.getLogger(__name__)

#: the file the measures are kept in, inside the cache folder
CACHE_FILE = "doctor-measures.json"
#: pairs per task of a worker process (big enough that sending them costs little)
_BATCH = 256


def _files(example: EditExample) -> list[Path]:
    return [*example.controls, example.target, *([example.mask] if example.mask is not None else [])]


def measure_pair(example: EditExample, cached: dict) -> tuple[str, dict]:
    """(the pair's cache key, its measures as a dict): every file read once and hashed (sha256, as the embedding
    cache's `identity.hash_file`); decoded and measured only when `cached` lacks the key."""
    read = [read_bytes(path) for path in _files(example)]
    parts = [sha for sha, _ in read] + ([] if example.mask is not None else ["-"])
    key = hashlib.sha256(f"doctor{VERSION}:{ANALYSIS_SIDE}|{len(example.controls)}|".encode()
                         + "|".join(parts).encode()).hexdigest()
    if key in cached:
        return key, cached[key]
    n = len(example.controls)
    pictures = PairPictures(example, decode(*read[n]), tuple(decode(*r) for r in read[:n]),
                            decode(*read[n + 1], grey=True) if example.mask is not None else None)
    return key, measure(pictures).as_dict()


#: a worker process's copy of the cached measures (set once per worker by `_keep_cache`, not sent with each batch)
_WORKER_CACHE: dict = {}


def _keep_cache(cached: dict) -> None:
    global _WORKER_CACHE
    _WORKER_CACHE = cached


def _measure_batch(examples: Sequence[EditExample], cached: Optional[dict] = None) -> list[tuple[str, dict]]:
    cached = _WORKER_CACHE if cached is None else cached
    return [measure_pair(e, cached) for e in examples]


def load_cache(path: Optional[Path]) -> dict:
    """The cached measures {key: measures dict}, empty when there is no (readable) cache file."""
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        log.warning("doctor cache %s unreadable (%s): measuring every pair again", path, err)
        return {}
    return data if isinstance(data, dict) else {}


def measure_all(examples: Sequence[EditExample], cache_dir: Optional[Path] = None, workers: int = 1,
                progress: Optional[Callable[[int, int], None]] = None) -> list[Measures]:
    """The measures of each example, in order: from the cache in `cache_dir` (CACHE_FILE) where the files' content
    is unchanged, the others measured (in `workers` processes when above 1) and added to it."""
    cache_path = Path(cache_dir) / CACHE_FILE if cache_dir is not None else None
    cached = load_cache(cache_path)
    batches = [list(examples[i:i + _BATCH]) for i in range(0, len(examples), _BATCH)]
    results: list[tuple[str, dict]] = []
    if workers > 1 and len(batches) > 1:
        with ProcessPoolExecutor(max_workers=workers, initializer=_keep_cache, initargs=(cached,)) as pool:
            for done in pool.map(_measure_batch, batches):
                results += done
                if progress:
                    progress(len(results), len(examples))
    else:
        for batch in batches:
            results += _measure_batch(batch, cached)
            if progress:
                progress(len(results), len(examples))
    fresh = {key: value for key, value in results if key not in cached}
    if cache_path is not None and fresh:
        cached.update(fresh)
        try:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes(cache_path, json.dumps(cached).encode("utf-8"))
        except OSError as err:  # only a cache: the run goes on, and the folder's own check names the problem
            log.warning("doctor: could not keep the measures in %s (%s); they are measured again next time",
                        cache_path, err.strerror or err)
    log.debug("doctor: %d pair(s) measured, %d from the cache", len(fresh), len(results) - len(fresh))
    return [Measures.from_dict(value) for _, value in results]


def diagnose(examples: Sequence[EditExample], held_out: Sequence[EditExample] = (),
             settings: DoctorSettings = DoctorSettings(), *, cache_dir: Optional[Path] = None, workers: int = 1,
             progress: Optional[Callable[[int, int], None]] = None) -> DoctorReport:
    """Every check on the training pairs `examples` and the `held_out` pairs (validated dataset examples):
    a DoctorReport, its findings worst first."""
    measures = measure_all([*examples, *held_out], cache_dir, workers, progress)
    pairs = [Measured(e.name, e, m) for e, m in zip(examples, measures)]
    held = [Measured(e.name, e, m) for e, m in zip(held_out, measures[len(examples):])]
    results = [swapped.check(pairs, settings), alignment.check(pairs, settings),
               references.check(pairs, settings), duplicates.check(pairs, held, settings),
               regions.check(pairs, settings), captions.check(pairs, settings), sizes.check(pairs, settings)]
    findings: list[Finding] = sorted((f for r in results for f in r.findings), key=lambda f: (-f.severity, f.pair))
    stats = {k: v for r in results for k, v in r.stats.items()}
    return DoctorReport(tuple(findings), len(pairs), len(held), tuple(n for r in results for n in r.notes), stats,
                        {p.name: (p.example, p.measures) for p in [*pairs, *held]})


def default_workers() -> int:
    """Worker processes for a large dataset: the CPUs this process may use, at most 4."""
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


@dataclass(frozen=True)
class DoctorRun:
    """A doctor run on a folder: the report, the report picture and page beside it (None when nothing is flagged or
    no output folder was given) and the fixes applied into the --fix folder (one line each)."""
    report: DoctorReport
    picture: Optional[Path] = None
    fixes: tuple[str, ...] = ()
    page: Optional[Path] = None


def doctor_folder(folder, examples: Sequence[EditExample], held_out: Sequence[EditExample] = (),
                  settings: DoctorSettings = DoctorSettings(), *, out_dir=None, fix_dir=None, cache_dir=None,
                  workers: int = 1) -> DoctorRun:
    """`diagnose` the pairs of dataset `folder`, then write the report (report.txt; report.png and report.html of
    the worst pairs) into `out_dir` and a fixed copy of the folder into `fix_dir`, when given."""
    report = diagnose(examples, held_out, settings, cache_dir=cache_dir, workers=workers)
    picture = write_report(report, out_dir) if out_dir is not None else None
    fixes = apply_fixes(report, folder, fix_dir, settings) if fix_dir is not None else []
    return DoctorRun(report, picture, tuple(fixes), html_path(picture) if picture else None)
