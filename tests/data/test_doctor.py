"""The dataset doctor on the planted-fault dataset (data/doctor/faulty.py: 24 "invert the colors" pairs of 64 px,
two controls each, with 3 swapped, 3 shifted by 6 to 12 px, 2 zoomed by 5 %, 2 near-duplicates, a mask on the wrong
half, the references of one pair reversed, and a held-out pair that repeats a training pair): every planted fault
found with its kind, at most one clean pair flagged, the fixes applied into a new folder (the shifted targets
realigned to within a pixel), each picture read and decoded once (the dataset reader's decode is the doctor's), the
measures cached by content."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from qwen_edit_core import cli
from qwen_edit_core.data.dataset import load_dataset
from qwen_edit_core.data.identity import hash_file
from qwen_edit_core.data.doctor import KINDS, DoctorSettings, diagnose, doctor_folder, runner
from qwen_edit_core.data.doctor.faulty import PLANTED, score, write_faulty_dataset
from qwen_edit_core.data.doctor.measure import gradient, register
from qwen_edit_core.data.doctor.pictures import full_rgb

SETTINGS = DoctorSettings(pixel_aligned=True)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    return write_faulty_dataset(tmp_path_factory.mktemp("doctor") / "faulty")


@pytest.fixture(scope="module")
def examples(faulty):
    return load_dataset(faulty.train).examples, load_dataset(faulty.heldout).examples


@pytest.fixture(scope="module")
def fixed(faulty, examples, tmp_path_factory):
    out = tmp_path_factory.mktemp("fixed")
    before = _hashes(faulty.train)
    run = doctor_folder(faulty.train, *examples, SETTINGS, out_dir=out / "report", fix_dir=out / "fixed")
    return run, out, before


def _hashes(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_every_planted_fault_is_found_and_at_most_one_clean_pair_flagged(faulty, fixed):
    report = fixed[0].report
    kinds = {(f.pair, f.kind) for f in report.findings}
    missed = {(pair, kind) for pair, kind in faulty.faults.items() if (pair, kind) not in kinds}
    assert not missed, f"planted faults not found: {missed}\n{report.summary(50)}"
    clean = [name for name in report.flagged if name not in faulty.faults]
    assert len(clean) <= 1, f"clean pairs flagged: {clean}\n{report.summary(50)}"
    assert len(faulty.faults) == len(PLANTED) + 1  # and the leak
    recall, precision = score(report, faulty)
    print(f"planted faults: recall {recall:.0%}, precision {precision:.0%} ({len(report.flagged)} pairs flagged)")
    assert recall == 1.0 and precision >= 13 / 14


def test_findings_name_the_pair_the_kind_the_figure_and_the_fix(fixed):
    for finding in fixed[0].report.findings:
        assert finding.kind in KINDS and finding.figure is not None and finding.why
    swapped = fixed[0].report.of_kind("swapped")
    assert all(f.figure < -0.2 and f.fix == "swap the control and the target" for f in swapped)
    shifted = {f.pair: f.figure for f in fixed[0].report.of_kind("misaligned")}
    assert shifted["pair003"] == {"dx": -6.0, "dy": 0.0, "zoom": pytest.approx(1.0, abs=0.01)}
    assert shifted["pair012"]["zoom"] == pytest.approx(1.05, abs=0.01)
    histogram = fixed[0].report.stats["shift_px"]  # the dataset's shifts: the 3 shifted pairs by 6 to 12 px
    assert sum(histogram.values()) == 24 and histogram["4-8"] + histogram["8-16"] == 3


def test_fix_realigns_the_shifted_and_zoomed_targets_to_within_a_pixel(faulty, fixed):
    _, out, _ = fixed
    for index, (kind, detail) in PLANTED.items():
        if kind != "misaligned":
            continue
        name = f"pair{index:03d}"
        control = np.asarray(full_rgb(out / "fixed" / f"{name}_control_1.png"), dtype=np.float32) / 255
        target = np.asarray(full_rgb(out / "fixed" / f"{name}.png"), dtype=np.float32) / 255
        shift, zoom, _ = register(gradient(control), gradient(target), upsample=10, rounds=3)
        corner = abs(zoom - 1) * control.shape[0] / 2  # how far the zoom moves the corners
        assert np.hypot(*shift) + corner <= 1.0, f"{name} ({detail}): {shift} px, zoom {zoom}"


def test_fix_writes_a_new_folder_and_leaves_the_original(faulty, fixed):
    run, out, before = fixed
    assert _hashes(faulty.train) == before
    after = diagnose(load_dataset(out / "fixed").examples, load_dataset(faulty.heldout).examples, SETTINGS)
    assert {(f.pair, f.kind) for f in after.findings} == {("held001", "leak")}, after.summary(50)
    assert not (out / "fixed" / "pair020.png").exists()  # the duplicate dropped
    swapped_back = np.asarray(full_rgb(out / "fixed" / "pair001.png"))
    assert np.array_equal(swapped_back, np.asarray(full_rgb(faulty.train / "pair001_control_1.png")))
    assert (out / "report" / "report.png").is_file() and run.picture == out / "report" / "report.png"
    assert "pair001: swapped control and target" in run.fixes


def test_the_html_report_beside_the_picture_shows_every_flagged_pair(fixed):
    run, out, _ = fixed
    assert run.page == out / "report" / "report.html" and run.picture.parent == run.page.parent
    page = run.page.read_text(encoding="utf-8")
    rows = re.findall(r'<tr id="([^"]+)">(.*?)</tr>', page, flags=re.S)
    assert [name for name, _ in rows] == run.report.flagged  # worst first, every one (13 < the page's 50)
    for name, row in rows:  # control, target and their difference, then each finding of the pair
        assert row.count('<img src="data:image/png;base64,') == 3, name
        assert all(f"<b>{f.kind}</b>" in row for f in run.report.findings if f.pair == name), name
    assert "invert the mask" in dict(rows)["pair018"]


def _count_decodes(monkeypatch) -> list:
    """Every picture PIL opens from now on (the dataset reader's, the doctor's), one entry each."""
    from PIL import Image
    opened, real_open = [], Image.open
    monkeypatch.setattr(Image, "open", lambda fp, *a, **k: opened.append(fp) or real_open(fp, *a, **k))
    return opened


def _pictures(*folders: Path) -> list[Path]:
    return [p for folder in folders for p in folder.iterdir() if p.suffix == ".png"]


def test_the_command_decodes_each_picture_once_and_a_second_run_measures_nothing(faulty, tmp_path, monkeypatch):
    from qwen_edit_core.api import doctor_dataset
    files = _pictures(faulty.train, faulty.heldout)
    opened = _count_decodes(monkeypatch)
    first = doctor_dataset(faulty.train, str(faulty.heldout), cache_dir=tmp_path).report
    assert len(opened) == len(files)  # the reader's decode is the doctor's: no second read
    assert (tmp_path / runner.CACHE_FILE).is_file()
    opened.clear()
    monkeypatch.setattr(runner, "measure", lambda pair: pytest.fail(f"{pair.example.name} measured again"))
    second = doctor_dataset(faulty.train, str(faulty.heldout), cache_dir=tmp_path).report
    assert len(opened) == len(files) and second.findings == first.findings


def test_without_the_reader_each_picture_is_read_once_and_keyed_by_its_content_hash(examples, tmp_path, monkeypatch):
    train, held = examples
    reads = []
    real_read = runner.read_bytes
    monkeypatch.setattr(runner, "read_bytes", lambda path: reads.append(Path(path)) or real_read(path))
    first = diagnose(train, held, SETTINGS, cache_dir=tmp_path)
    files = [p for e in (*train, *held) for p in (*e.controls, e.target, *([e.mask] if e.mask else []))]
    assert sorted(reads) == sorted(files)
    assert runner.read_bytes(files[0])[0] == hash_file(files[0])  # the embedding cache's content hash
    measured = runner.PairMeasurer(tmp_path)
    load_dataset(train[0].target.parent, on_pair=measured)  # the reader's hashes give the same keys
    assert set(measured.keys.values()) <= set(measured.cached) and not measured.fresh
    monkeypatch.setattr(runner, "measure", lambda pair: pytest.fail(f"{pair.example.name} measured again"))
    second = diagnose(train, held, SETTINGS, cache_dir=tmp_path)
    assert second.findings == first.findings


def test_cli_json_prints_one_object_per_finding_and_names_the_report(faulty, tmp_path, capsys, caplog):
    with caplog.at_level(logging.INFO, logger="qwen_edit_core.cli"):
        code = cli.main(["doctor", str(faulty.train), "--held-out", str(faulty.heldout), "--json",
                         "--out", str(tmp_path / "report")])
    assert f"report of the worst pairs: {tmp_path / 'report' / 'report.html'}" in caplog.text
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and lines
    found = [json.loads(line) for line in lines]
    assert all(set(f) >= {"pair", "kind", "figure", "fix"} and f["kind"] in KINDS for f in found)
    assert {"pair": "held001", "kind": "leak"}.items() <= next(f for f in found if f["kind"] == "leak").items()


def test_a_reference_copying_the_target_is_named_not_dropped_as_unchanged(faulty, examples, tmp_path):
    folder = tmp_path / "train"
    shutil.copytree(faulty.train, folder)
    shutil.copyfile(folder / "pair007.png", folder / "pair007_control_2.png")
    report = diagnose(load_dataset(folder).examples, (), SETTINGS)
    found = [f for f in report.findings if f.pair == "pair007"]
    assert [(f.kind, f.fix) for f in found] == [("duplicate", "replace control 2 (a copy of the target)")], found
    assert report.statistics()[0].startswith("edit direction strength R")


def test_an_unchanged_pair_whose_closest_control_is_not_the_edited_slot_is_a_copied_reference():
    from types import SimpleNamespace

    from qwen_edit_core.data.doctor import references
    from qwen_edit_core.data.doctor.findings import CheckResult, Measured
    pairs = [Measured(f"p{i}", None, SimpleNamespace(change=40.0, reference_ncc=(0.9, 0.2), source=0))
             for i in range(5)]
    pairs += [Measured("copied", None, SimpleNamespace(change=0.1, reference_ncc=(0.8, 1.0), source=1)),
              Measured("single", None, SimpleNamespace(change=0.1, reference_ncc=(1.0,), source=0))]
    result = CheckResult()
    references._no_change(pairs, 0, result)
    assert [(f.pair, f.kind, f.fix) for f in result.findings] == [
        ("copied", "duplicate", "replace control 2 (a copy of the target)"), ("single", "no-change", "drop the pair")]


def test_a_hash_match_is_a_duplicate_only_when_the_pictures_levels_agree():
    from types import SimpleNamespace

    from qwen_edit_core.data.doctor import duplicates
    from qwen_edit_core.data.doctor.findings import Measured
    base = np.linspace(0.2, 0.8, 24)

    def pair(name, offset):  # one hash for all: only the levels (shifted by `offset` 8-bit levels) tell them apart
        features = tuple(base + offset / 255)
        return Measured(name, None, SimpleNamespace(hashes=(7, 9), source=0, target_features=features,
                                                    control_features=features))
    found = duplicates.check([pair("a", 0), pair("b", 4), pair("c", 20)], [pair("h", 19)], SETTINGS).findings
    assert [(f.pair, f.kind, f.fix) for f in found] == [
        ("b", "duplicate", "drop the pair (it repeats a)"), ("h", "leak", "hold out another pair (this one is "
                                                                          "trained on as c)")]


def test_an_edit_without_a_common_direction_says_so_instead_of_guessing():
    from types import SimpleNamespace

    from qwen_edit_core.data.doctor import swapped
    from qwen_edit_core.data.doctor.findings import Measured
    rng = np.random.default_rng(0)
    pairs = [Measured(f"p{i}", None, SimpleNamespace(control_features=tuple(c), target_features=tuple(c + d)))
             for i, (c, d) in enumerate(zip(rng.normal(size=(24, 24)), rng.normal(size=(24, 24))))]
    result = swapped.check(pairs, SETTINGS)
    assert not result.findings and result.notes[0].startswith("no common edit direction")


def test_the_benchmark_runs_on_a_small_dataset(capsys):
    from qwen_edit_core.bench import doctor
    rates = doctor.run(pairs=30, workers=1)
    assert set(rates) == {"dataset reader alone", "reader + doctor, cold", "reader + doctor, warm"}
    assert "30 pairs of 64 px" in capsys.readouterr().out


def test_helper_processes_measure_what_the_reader_hands_over_alike(faulty, fixed, monkeypatch):
    from qwen_edit_core.api import doctor_dataset
    monkeypatch.setattr(runner, "_BATCH", 4)  # several batches sent to the helpers, a few waiting at a time
    started, real_pool = [], runner.ProcessPoolExecutor
    monkeypatch.setattr(runner, "ProcessPoolExecutor", lambda **kw: started.append(kw) or real_pool(**kw))
    report = doctor_dataset(faulty.train, str(faulty.heldout), pixel_aligned=True, workers=2).report
    assert [kw["max_workers"] for kw in started] == [2] and report.findings == fixed[0].report.findings


def test_an_error_after_the_helpers_started_leaves_no_helper_process(tmp_path, monkeypatch):
    """A held-out setting refused once the first batch went to the helper processes: the processes end with the
    run (a long-lived process such as ComfyUI would keep them otherwise)."""
    import multiprocessing

    from qwen_edit_core.api import doctor_dataset
    from qwen_edit_core.data.synthetic import DEMO_EDIT, write_pairs
    write_pairs(tmp_path / "pairs", 3, 0, DEMO_EDIT[0], 64)
    monkeypatch.setattr(runner, "_BATCH", 1)  # each pair a batch: the helpers start at the first pair
    started, real_pool = [], runner.ProcessPoolExecutor
    monkeypatch.setattr(runner, "ProcessPoolExecutor", lambda **kw: started.append(real_pool(**kw)) or started[-1])
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="train.validation_pairs 5"):
        doctor_dataset(tmp_path / "pairs", 5, workers=2)
    assert started and set(multiprocessing.active_children()) <= before
