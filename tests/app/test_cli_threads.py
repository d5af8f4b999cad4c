"""The CLI sets torch's CPU threads as the demo does: `--threads N`, or by default 1 on a small or busy machine
(common/threads.py), for the command's work only."""

from __future__ import annotations

import pytest
import torch
import yaml

from qwen_edit_core.cli import main
from qwen_edit_core.common.threads import default_threads
from qwen_edit_core.train.loop import TrainResult


@pytest.mark.parametrize("flag, expected", [([], None), (["--threads", "3"], 3)])
def test_train_runs_on_the_chosen_threads(tiny_edit_dir, pairs_dir, tmp_path, monkeypatch, flag, expected):
    import qwen_edit_core.api as api
    seen = []

    def fit(self, **kwargs):
        seen.append(torch.get_num_threads())
        return TrainResult(state="done", step=1, lora_path=None, loss_plot=None)
    monkeypatch.setattr(api.QwenImageEditTrainer, "fit", fit)
    before = torch.get_num_threads()
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"pretrained_model_name_or_path": str(tiny_edit_dir)},
                                    "data": {"folder": str(pairs_dir)}, "train": {"output_dir": str(tmp_path / "o")}}))
    assert main(["train", str(path), *flag]) == 0
    assert seen == [expected or default_threads()] and torch.get_num_threads() == before


def test_a_negative_thread_count_is_refused(tiny_edit_dir, pairs_dir, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"pretrained_model_name_or_path": str(tiny_edit_dir)},
                                    "data": {"folder": str(pairs_dir)}, "train": {"output_dir": str(tmp_path / "o")}}))
    assert main(["train", str(path), "--threads", "-2"]) == 2
    assert "threads=-2: give a positive count" in capsys.readouterr().err
