"""`--resume` checks the checkpoint against the run before any weight loads and refuses in one line naming the
checkpoint and what differs: the adapter (rank, kind, targets, the model's family), the optimizer and schedule,
and damaged files."""

from __future__ import annotations

import pytest
import yaml

from qwen_edit_core import QwenImageEditTrainer
from qwen_edit_core.cli import main
from qwen_edit_core.preflight import ResumeMismatchError
from qwen_edit_core.train.checkpoint import latest_checkpoint

from conftest import train_config


@pytest.fixture(scope="module")
def finished(tiny_edit_dir, pairs_dir, tmp_path_factory):
    """A finished 2-step run's output folder (LoRA rank 4 on "attn")."""
    out = tmp_path_factory.mktemp("resume") / "o"
    QwenImageEditTrainer(_config(tiny_edit_dir, pairs_dir, out)).fit()
    return out


def _config(model, data, out, lora=None, steps=2, **sections):
    return train_config(model, data, out, out.parent / "cache", model={
        "pretrained_model_name_or_path": str(model), "lora": {"rank": 4, "alpha": 4.0, "targets": "attn", **(lora or {})}},
        train={"output_dir": str(out), "max_steps": steps, "seed": 3}, **sections)


@pytest.fixture
def no_weights(monkeypatch):
    import qwen_edit_core.api as api
    import qwen_edit_core.model.components as components

    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the checkpoint was checked")
    monkeypatch.setattr(api, "load_components", refuse)
    monkeypatch.setattr(components, "load_components", refuse)


def test_a_changed_rank_or_learning_rate_is_refused_naming_the_checkpoint_and_key(finished, tiny_edit_dir, pairs_dir,
                                                                                  tmp_path, capsys, no_weights):
    checkpoint = latest_checkpoint(finished / "checkpoints").path
    config = _config(tiny_edit_dir, pairs_dir, finished, lora={"rank": 8}, optimizer={"lr": 5e-4})
    with pytest.raises(ResumeMismatchError) as err:
        QwenImageEditTrainer(config).fit(resume=True)
    text = str(err.value)
    assert text.startswith(f"--resume {str(checkpoint)!r} cannot continue this run: ") and "\n" not in text
    assert "model.lora.rank is 4 in the checkpoint, 8 now" in text
    assert "optimizer.lr is 0.001 in the checkpoint, 0.0005 now" in text
    assert "its adapter is not this run's" in text
    path = tmp_path / "c.yaml"
    from qwen_edit_core.config import to_dict
    path.write_text(yaml.safe_dump(to_dict(_config(tiny_edit_dir, pairs_dir, finished, lora={"rank": 8}))))
    assert main(["train", str(path), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "model.lora.rank is 4 in the checkpoint, 8 now" in err and "Traceback" not in err


def test_fewer_targets_are_refused_not_narrowed_away(finished, tiny_edit_dir, pairs_dir, no_weights):
    """Resuming an "attn" run with "attn-img" (a subset of its layers) is refused: only layers whose output reaches
    no loss may be left out of a resumed optimizer state."""
    config = _config(tiny_edit_dir, pairs_dir, finished, lora={"targets": "attn-img"})
    with pytest.raises(ResumeMismatchError, match="model.lora.targets is .* in the checkpoint.*its adapter is not"):
        QwenImageEditTrainer(config).fit(resume=True)


def test_a_checkpoint_of_another_model_family_is_refused(finished, tiny_21_dir, pairs_dir, tmp_path, no_weights):
    checkpoint = latest_checkpoint(finished / "checkpoints").path
    config = _config(tiny_21_dir, pairs_dir, tmp_path / "o21")
    with pytest.raises(ResumeMismatchError, match="its adapter is not this run's .*another model family"):
        QwenImageEditTrainer(config).check_fit_inputs(resume=checkpoint)


@pytest.mark.parametrize("damage", ["cut", "missing"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(finished, tiny_edit_dir, pairs_dir, tmp_path, no_weights,
                                                         damage):
    import shutil
    copy = tmp_path / "ckpt"
    shutil.copytree(latest_checkpoint(finished / "checkpoints").path, copy)
    optimizer = copy / "optimizer.pt"
    if damage == "cut":
        optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])
    else:
        optimizer.unlink()
    config = _config(tiny_edit_dir, pairs_dir, tmp_path / "o")
    expected = "optimizer.pt cannot be read" if damage == "cut" else "optimizer.pt is missing"
    with pytest.raises(ResumeMismatchError, match=f"--resume '.*ckpt' cannot continue this run: {expected}"):
        QwenImageEditTrainer(config).fit(resume=copy)


def test_the_same_settings_resume(finished, tiny_edit_dir, pairs_dir):
    result = QwenImageEditTrainer(_config(tiny_edit_dir, pairs_dir, finished, steps=3)).fit(resume=True)
    assert result.step == 3
