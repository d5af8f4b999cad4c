"""Running the doctor: measure every pair from the one read and decode of its files (the dataset reader's, handed
over through `PairMeasurer`, or its own), or take its measures from the cache by the content hashes of its files;
run every check family, and collect the findings worst first."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Container, Optional, Sequence

from qwen_edit_core.common.files import write_bytes
from qwen_edit_core.data.doctor import alignment, captions, duplicates, references, regions, sizes, swapped
from qwen_edit_core.data.doctor.findings import DoctorReport, DoctorSettings, Finding, Measured
from qwen_edit_core.data.doctor.measure import VERSION, Measures, measure
from qwen_edit_core.data.doctor.pictures import ANALYSIS_SIDE, PairPictures, Picture, decode, picture_of, read_bytes
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


def pair_key(example: EditExample, hashes: Sequence[str]) -> str:
    """The pair's cache key: the sha256 of its files' content hashes (`hashes`, in `_files` order: the embedding
    cache's `identity.hash_file` of each), with the measures' version and analysis size."""
    parts = list(hashes) + ([] if example.mask is not None else ["-"])
    return hashlib.sha256(f"doctor{VERSION}:{ANALYSIS_SIDE}|{len(example.controls)}|".encode()
                          + "|".join(parts).encode()).hexdigest()


def _pair(example: EditExample, pictures: Sequence[Picture]) -> PairPictures:
    """The PairPictures of a pair from its `_files`' Pictures, in that order."""
    n = len(example.controls)
    mask = pictures[n + 1] if example.mask is not None else None
    return PairPictures(example, pictures[n], tuple(pictures[:n]), mask)


def _greys(example: EditExample) -> list[bool]:
    """Whether each of `_files` is read as grey (the mask, last) or RGB."""
    return [False] * (len(example.controls) + 1) + [True]


def measure_pair(example: EditExample, known: Container[str]) -> tuple[str, Optional[dict]]:
    """(the pair's cache key, its measures as a dict) for a pair the dataset reader did not hand over: every file
    read once and hashed; decoded and measured only when its key is not in `known` (the cache's keys; then None)."""
    read = [read_bytes(path) for path in _files(example)]
    key = pair_key(example, [sha for sha, _ in read])
    if key in known:
        return key, None
    return key, measure(_pair(example, [decode(*r, grey=g) for r, g in zip(read, _greys(example))])).as_dict()


class PairMeasurer:
    """The doctor's measures of a dataset's pairs, taken as the dataset reader validates them: pass it as
    `load_dataset(on_pair=...)` and each pair is measured from the reader's own decode of its files (no second read)
    unless the cache in `cache_dir` (CACHE_FILE) already holds its files' content. With `workers` above 1, that
    many processes measure the pairs while this one reads on (the measuring is two thirds of the work), and the
    same processes read and measure the pairs the reader did not hand over (`measure_unread`). `diagnose` takes it
    as `measured`, measures what it lacks, and `save`s the new measures there. Use it in a `with` block: an error
    before `finish` (a bad dataset, a bad held-out setting) still stops the processes."""

    def __init__(self, cache_dir=None, workers: int = 1):
        self.cache_path = Path(cache_dir) / CACHE_FILE if cache_dir is not None else None
        self.cached = load_cache(self.cache_path)
        self.fresh: dict = {}  # key -> measures of this run's pairs the cache lacked
        self.keys: dict = {}  # EditExample -> its key
        self.helpers = workers if workers > 1 else 0
        self._pool: Optional[ProcessPoolExecutor] = None
        self._batch: list[tuple[str, PairPictures]] = []
        self._pending: deque = deque()  # (what takes the result, future) of each task sent, oldest first

    def __call__(self, example: EditExample, checks: dict) -> None:
        """Measure `example` from its files' `images.ImageCheck`s (by path), unless its key is known."""
        key = pair_key(example, [checks[path].sha256 for path in _files(example)])
        self.keys[example] = key
        if key in self.cached or key in self.fresh:
            return
        pair = _pair(example, [picture_of(checks[path].sha256, checks[path].image, grey=grey)
                               for path, grey in zip(_files(example), _greys(example))])
        if not self.helpers:
            self.fresh[key] = measure(pair).as_dict()
            return
        self.fresh[key] = None  # sent: its measures arrive with `finish`
        self._batch.append((key, pair))
        if len(self._batch) >= _BATCH:
            self._send()

    def _submit(self, take: Callable, task: Callable, *args) -> None:
        """Run `task(*args)` in a helper process (the pool starts with the first task) and `take` its result when
        it comes; at most two tasks a helper wait (the pictures held in memory stay bounded however fast the
        reader is)."""
        if self._pool is None:  # each helper is given the cache's keys once, for `measure_unread`'s batches
            self._pool = ProcessPoolExecutor(max_workers=self.helpers, initializer=_remember_known,
                                             initargs=(frozenset(self.cached),))
        self._pending.append((take, self._pool.submit(task, *args)))
        while len(self._pending) > 2 * self.helpers:
            self._receive()

    def _send(self) -> None:
        """Send the gathered pairs to the helpers."""
        if not self._batch:
            return
        keys, pairs = zip(*self._batch)
        self._batch = []
        self._submit(lambda measures: self.fresh.update(zip(keys, measures)), _measure_pictures, pairs)

    def _receive(self) -> None:
        """Wait for the oldest task sent and take its result."""
        take, future = self._pending.popleft()
        take(future.result())

    def drain(self) -> None:
        """Wait for every task sent (a last batch with no pool started yet, a small dataset's, is measured here:
        starting a process would cost more)."""
        if self._pool is None and self._batch:
            keys, pairs = zip(*self._batch)
            self.fresh.update(zip(keys, _measure_pictures(pairs)))
            self._batch = []
        self._send()
        while self._pending:
            self._receive()

    def measure_unread(self, examples: Sequence[EditExample],
                       progress: Optional[Callable[[int], None]] = None) -> dict:
        """{example: its measures dict} of pairs the reader did not hand over, each read, hashed and (unless
        cached) measured, in batches on the helpers when there are several; `progress(n)` after each batch with
        the pairs done so far. Their keys and new measures are kept as the reader's are."""
        batches = [list(examples[i:i + _BATCH]) for i in range(0, len(examples), _BATCH)]
        done: dict = {}

        def take(batch: Sequence[EditExample], results: list[tuple[str, Optional[dict]]]) -> None:
            for example, (key, value) in zip(batch, results):
                self.keys[example] = key
                if self.get(key) is None:
                    self.fresh[key] = value
                done[example] = value if value is not None else self.get(key)
            if progress:
                progress(len(done))

        for batch in batches:
            if self.helpers and len(batches) > 1:
                self._submit(lambda results, batch=batch: take(batch, results), _measure_known_batch, batch)
            else:
                take(batch, _measure_batch(batch, self.cached))
        self.drain()
        return done

    def finish(self) -> None:
        """Wait for the measures the helper processes are taking, then let them go."""
        self.drain()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def close(self) -> None:
        """Stop the helper processes, dropping the measures not received yet (`finish` is the end of a run that
        went well; after it this does nothing). The processes are gone when it returns: a long-lived process
        (ComfyUI) keeps none of them after a failed run."""
        self._batch = []
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)  # waits for the batches already being measured
            self._pool = None

    def __enter__(self) -> "PairMeasurer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get(self, key: str) -> Optional[dict]:
        """The measures of `key`, cached or measured in this run (None: unknown, or not yet `finish`ed)."""
        return self.cached.get(key, self.fresh.get(key))

    def save(self) -> None:
        """Add this run's measures to the cache file (a cache only: a failure is logged, never raised)."""
        if self.cache_path is None or not self.fresh:
            return
        self.cached.update(self.fresh)
        self.fresh = {}
        try:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes(self.cache_path, json.dumps(self.cached).encode("utf-8"))
        except OSError as err:  # the run goes on, and the folder's own check names the problem
            log.warning("doctor: could not keep the measures in %s (%s); they are measured again next time",
                        self.cache_path, err.strerror or err)


def _measure_pictures(pairs: Sequence[PairPictures]) -> list[dict]:
    """The measures (as dicts) of pairs already read (a helper process's task)."""
    return [measure(pair).as_dict() for pair in pairs]


def _measure_batch(examples: Sequence[EditExample], known: Container[str]) -> list[tuple[str, Optional[dict]]]:
    """`measure_pair` of each of `examples` (run here)."""
    return [measure_pair(e, known) for e in examples]


#: a helper process's copy of the cache's keys (`_remember_known`, its pool's initializer): sent once per process
#: rather than with each batch of `measure_unread` (for 10,000 cached pairs about 0.7 MB a batch)
_known: frozenset = frozenset()


def _remember_known(keys: frozenset) -> None:
    global _known
    _known = keys


def _measure_known_batch(examples: Sequence[EditExample]) -> list[tuple[str, Optional[dict]]]:
    """`measure_pair` of each of `examples` against the keys its helper process was given (a helper's task)."""
    return _measure_batch(examples, _known)


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


def measure_all(examples: Sequence[EditExample], measured: PairMeasurer,
                progress: Optional[Callable[[int, int], None]] = None) -> list[Measures]:
    """The measures of each example, in order: those `measured` took from the dataset reader or its cache, the
    others read, hashed and measured by it (`measure_unread`, on its helper processes); then its helpers let go and
    `measured.save()`."""
    measured.drain()
    known = {e: measured.get(measured.keys[e]) for e in examples if e in measured.keys}
    todo = [e for e in examples if known.get(e) is None]
    done = measured.measure_unread(todo, progress and (lambda n: progress(len(known) + n, len(examples))))
    measured.finish()
    log.debug("doctor: %d pair(s) measured in this run, the others' measures from the cache", len(measured.fresh))
    measured.save()
    return [Measures.from_dict(known.get(e) or done[e]) for e in examples]


def diagnose(examples: Sequence[EditExample], held_out: Sequence[EditExample] = (),
             settings: DoctorSettings = DoctorSettings(), *, cache_dir: Optional[Path] = None, workers: int = 1,
             progress: Optional[Callable[[int, int], None]] = None, text_encoder=None,
             measured: Optional[PairMeasurer] = None,
             count_tokens: Optional[Callable[[str], int]] = None) -> DoctorReport:
    """Every check on the training pairs `examples` and the `held_out` pairs (validated dataset examples):
    a DoctorReport, its findings worst first. `measured`: the PairMeasurer the dataset reader handed the pairs to
    (its cache folder and helper processes, not `cache_dir` and `workers`, are used); without it each picture is
    read here, once, in `workers` processes. `count_tokens`: the
    text encoder's tokenizer, for the captions' lengths (None: a note says they were not checked). With an already
    loaded `text_encoder` (model.components.TextEncoder) it also asks it whether each target shows its caption's
    edit (`vlm`)."""
    if measured is None:  # its own, whose helper processes end with the measuring
        with PairMeasurer(cache_dir, workers) as own:
            measures = measure_all([*examples, *held_out], own, progress)
    else:
        measures = measure_all([*examples, *held_out], measured, progress)
    pairs = [Measured(e.name, e, m) for e, m in zip(examples, measures)]
    held = [Measured(e.name, e, m) for e, m in zip(held_out, measures[len(examples):])]
    results = [swapped.check(pairs, settings), alignment.check(pairs, settings),
               references.check(pairs, settings), duplicates.check(pairs, held, settings),
               regions.check(pairs, settings), captions.check(pairs, settings, count_tokens),
               sizes.check(pairs, settings)]
    if text_encoder is not None:
        from qwen_edit_core.data.doctor import vlm
        results.append(vlm.check(pairs, text_encoder))
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
                  workers: int = 1, text_encoder=None, measured: Optional[PairMeasurer] = None,
                  count_tokens: Optional[Callable[[str], int]] = None) -> DoctorRun:
    """`diagnose` the pairs of dataset `folder`, then write the report (report.txt; report.png and report.html of
    the worst pairs) into `out_dir` and a fixed copy of the folder into `fix_dir`, when given."""
    report = diagnose(examples, held_out, settings, cache_dir=cache_dir, workers=workers, text_encoder=text_encoder,
                      measured=measured, count_tokens=count_tokens)
    picture = write_report(report, out_dir) if out_dir is not None else None
    fixes = apply_fixes(report, folder, fix_dir, settings) if fix_dir is not None else []
    return DoctorRun(report, picture, tuple(fixes), html_path(picture) if picture else None)
