"""A run never writes over another run: a finished or foreign run's folder is refused (or moved aside with
--overwrite), checkpoints are pruned among the run's own, --resume never continues another run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from qwen_edit_core import QwenImageEditTrainer
from qwen_edit_core.cli import main
from qwen_edit_core.train.checkpoint import STATE_FILE, list_checkpoints, prune
from qwen_edit_core.train.loop import resolve_resume
from qwen_edit_core.train.run_folder import OutputDirTakenError

from conftest import train_config


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if any component would load (the refusal must come first)."""
    import qwen_edit_core.api as api
    import qwen_edit_core.model.components as components

    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the refusal")
    monkeypatch.setattr(api, "load_components", refuse)
    monkeypatch.setattr(components, "load_components", refuse)


def _cfg(tmp_path, model, data, out, **train) -> Path:
    cfg = {"model": {"pretrained_model_name_or_path": str(model), "lora": {"rank": 4, "targets": "attn"}},
           "data": {"folder": str(data), "vae_area": 4096, "batch_size": 1}, "cache": {"dir": str(tmp_path / "cache")},
           "train": {"output_dir": str(out), "seed": 3, **train}}
    path = tmp_path / f"c{len(list(tmp_path.glob('c*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _fake_checkpoint(root: Path, step: int, run_id: str | None) -> Path:
    path = root / f"step-{step:07d}"
    path.mkdir(parents=True)
    (path / STATE_FILE).write_text(json.dumps({"step": step, "run_id": run_id}))
    return path


def test_a_new_run_into_a_finished_runs_folder_is_refused_before_weights(tiny_edit_dir, pairs_dir, tmp_path,
                                                                           capsys, monkeypatch):
    out = tmp_path / "o"
    assert main(["train", str(_cfg(tmp_path, tiny_edit_dir, pairs_dir, out, max_steps=3, checkpoint_every=1))]) == 0
    lora = (out / "lora.safetensors").read_bytes()
    steps = [c.step for c in list_checkpoints(out / "checkpoints")]
    import qwen_edit_core.api as api
    import qwen_edit_core.model.components as components
    monkeypatch.setattr(api, "load_components", lambda *a, **k: pytest.fail("weights loaded before the refusal"))
    monkeypatch.setattr(components, "load_components", lambda *a, **k: pytest.fail("weights loaded"))
    capsys.readouterr()
    assert main(["train", str(_cfg(tmp_path, tiny_edit_dir, pairs_dir, out, max_steps=2))]) == 2
    err = capsys.readouterr().err
    assert f"output directory {str(out)!r} (train.output_dir) holds another run" in err
    assert "lora.safetensors" in err and "up to step 3" in err
    assert "--resume" in err and "--output-dir" in err and "--overwrite" in err and "Traceback" not in err
    assert (out / "lora.safetensors").read_bytes() == lora
    assert [c.step for c in list_checkpoints(out / "checkpoints")] == steps
    with pytest.raises(OutputDirTakenError):
        QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, out)).check_fit_inputs()


def test_overwrite_moves_the_old_run_aside_and_resume_continues_the_new_one(tiny_edit_dir, pairs_dir, tmp_path):
    out = tmp_path / "o"
    assert main(["train", str(_cfg(tmp_path, tiny_edit_dir, pairs_dir, out, max_steps=4, checkpoint_every=1,
                                   keep_checkpoints=2))]) == 0
    old = (out / "lora.safetensors").read_bytes()
    second = _cfg(tmp_path, tiny_edit_dir, pairs_dir, out, max_steps=2, checkpoint_every=1, keep_checkpoints=2)
    assert main(["train", str(second), "--overwrite"]) == 0
    aside = list(tmp_path.glob("o.replaced-*"))
    assert len(aside) == 1 and (aside[0] / "lora.safetensors").read_bytes() == old
    assert [c.step for c in list_checkpoints(aside[0] / "checkpoints")] == [3, 4]
    mine = list_checkpoints(out / "checkpoints")
    assert [c.step for c in mine] == [1, 2] and len({c.state["run_id"] for c in mine}) == 1
    assert (out / "cache").is_dir() or (tmp_path / "cache").is_dir()
    assert resolve_resume(out, True) == mine[-1].path


def test_checkpoints_are_pruned_only_among_the_runs_own(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30):
        _fake_checkpoint(root, step, "old")
    for step in (1, 2, 3):
        _fake_checkpoint(root / "new", step, "new")  # not under root: a second folder
    for step in (4, 5):
        _fake_checkpoint(root, step, "new")
    prune(root, 1, "new")
    assert [(c.step, c.state["run_id"]) for c in list_checkpoints(root)] == [(5, "new"), (10, "old"), (20, "old"),
                                                                             (30, "old")]


def test_resume_never_picks_another_runs_checkpoint(tmp_path, tiny_edit_dir, pairs_dir, no_weights):
    out = tmp_path / "o"
    _fake_checkpoint(out / "checkpoints", 12, "mine")
    _fake_checkpoint(out / "checkpoints", 30, "older")
    with pytest.raises(ValueError, match=r"holds checkpoints of 2 runs; give the one to continue \(--resume PATH\)"):
        resolve_resume(out, True)
    # a checkpoint of another folder resumed into this one: its checkpoints are another run's
    elsewhere = _fake_checkpoint(tmp_path / "x" / "checkpoints", 2, "third")
    config = train_config(tiny_edit_dir, pairs_dir, out)
    with pytest.raises(OutputDirTakenError, match="checkpoints of another run"):
        QwenImageEditTrainer(config).check_fit_inputs(resume=elsewhere)


@pytest.mark.parametrize("how", ["flag", "yaml", "env"])
def test_an_empty_output_dir_is_refused_naming_its_key_before_anything_is_written(tiny_edit_dir, pairs_dir, tmp_path,
                                                                                  monkeypatch, capsys, how):
    """`--output-dir ''`, `output_dir: ""` and `${VAR}` with VAR set to "" would train into the current folder."""
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("EMPTY_OUT", "")
    out = {"flag": str(tmp_path / "o"), "yaml": "", "env": "${EMPTY_OUT}"}[how]
    path = _cfg(tmp_path, tiny_edit_dir, pairs_dir, out, max_steps=1)
    assert main(["train", str(path), *(["--output-dir", ""] if how == "flag" else [])]) == 2
    err = capsys.readouterr().err
    assert "train.output_dir: '' must be a folder (empty would write into the current directory)" in err, err
    assert list(work.iterdir()) == [] and not (tmp_path / "o").exists()
