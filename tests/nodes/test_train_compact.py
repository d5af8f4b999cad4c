"""The compact Train LoRA node and its Train Options: few widgets, the full node's settings all reachable,
and the same job started as the full (deprecated, still loadable) node."""

from __future__ import annotations

from dataclasses import fields

import nodes
from nodes.train_compact import ESSENTIAL, QwenEditTrainLoRA, QwenEditTrainOptions, TrainOptions
from nodes.train_nodes import QwenEditTrain


def _spec(cls) -> dict:
    spec = cls.INPUT_TYPES()
    return {**spec["required"], **spec.get("optional", {})}


def _default(value):
    return value[0][0] if isinstance(value[0], list) else value[1].get("default")


def test_compact_node_has_the_essentials_and_options_the_rest():
    """Together the two nodes offer every input of the full node, none twice; the compact one holds 13
    widgets at most (the full node's 31 did not fit a 1920x1080 screen at a readable zoom)."""
    compact, options, full = _spec(QwenEditTrainLoRA), _spec(QwenEditTrainOptions), _spec(QwenEditTrain)
    assert set(compact) - {"options"} | set(options) == set(full)
    assert not set(compact) & set(options)
    widgets = [n for n, v in compact.items() if isinstance(v[0], list) or v[0] in ("INT", "FLOAT", "STRING",
                                                                                    "BOOLEAN")]
    assert len(widgets) <= 13, widgets
    assert list(compact)[2:2 + len(ESSENTIAL)] == list(ESSENTIAL)
    for name, value in {**compact, **options}.items():
        assert value[1].get("tooltip"), name


def test_option_defaults_are_the_full_nodes():
    """An unconnected options input trains like the full node left at its defaults."""
    full = _spec(QwenEditTrain)
    assert {f.name: f.default for f in fields(TrainOptions)} == {f.name: _default(full[f.name])
                                                                 for f in fields(TrainOptions)}


def test_validation_prompt_is_labelled():
    """A multiline box shows its name only while empty: the compact node's prompt has a placeholder."""
    assert "validation" in _spec(QwenEditTrainLoRA)["validation_prompt"][1]["placeholder"]


def test_full_node_is_deprecated_and_both_nodes_are_registered():
    assert QwenEditTrain.DEPRECATED is True
    assert not getattr(QwenEditTrainLoRA, "DEPRECATED", False)
    for node_id in ("QwenEditTrain", "QwenEditTrainLoRA", "QwenEditTrainOptions"):
        assert node_id in nodes.NODE_CLASS_MAPPINGS and node_id in nodes.NODE_DISPLAY_NAME_MAPPINGS


def test_compact_node_starts_the_full_nodes_job(monkeypatch):
    """Every value of both nodes reaches the full node's start under its own name."""
    seen = {}
    monkeypatch.setattr(QwenEditTrain, "start", lambda self, model, dataset, **kw: seen.update(kw) or ("job",))
    options = {f.name: _default(_spec(QwenEditTrainOptions)[f.name]) for f in fields(TrainOptions)}
    options.update(alpha=8.0, seed=7, lora_type="lokr", ema_decay=0.999, mask_weight=3.0,
                   validation_previews="lightning steps=4", job_name="j", cpu_threads=2)
    (opts,) = QwenEditTrainOptions().options(**options)
    essentials = dict(lora_name="x", steps=5, learning_rate=1e-3, rank=4, targets="all", batch_size=2, resolution=128,
                      checkpoint_every=0, use_cache=False, resume=True)
    assert QwenEditTrainLoRA().start("m", "d", **essentials, validation_image="img", validation_every=3,
                                     validation_prompt="p", options=opts) == ("job",)
    assert seen == {**essentials, **options, "validation_image": "img", "validation_every": 3,
                    "validation_prompt": "p", "overwrite": False}


def test_live_view_is_drawn_on_the_compact_node():
    from pathlib import Path
    script = (Path(__file__).resolve().parents[2] / "web" / "qwen_edit_jobs.js").read_text()
    assert '"QwenEditTrainLoRA"' in script and "getInputNode" in script


def test_the_jobs_cpu_threads_reach_its_config(tiny_edit_dir, pairs_dir, env, monkeypatch):
    """Train Options' cpu_threads is the job's `train.cpu_threads` (0, unconnected: auto)."""
    import types

    import torch

    from nodes import train_nodes

    started = []
    monkeypatch.setattr(train_nodes.jobs.REGISTRY, "start", lambda config, **kw: started.append(config) or types.SimpleNamespace(device="cpu"))
    monkeypatch.setattr(train_nodes.comfy_runtime, "count_job", lambda *args: None)
    with torch.inference_mode():
        (model,) = nodes.QwenEditModelLoader().load("", "cpu", "cpu", "cpu", "float32", path=str(tiny_edit_dir))
        data, _ = nodes.QwenEditDataset().load(str(pairs_dir), False)["result"]
        options = {f.name: _default(_spec(QwenEditTrainOptions)[f.name]) for f in fields(TrainOptions)}
        for threads in (1, 0):
            (opts,) = QwenEditTrainOptions().options(**{**options, "cpu_threads": threads})
            QwenEditTrainLoRA().start(model, data, f"threads{threads}", 1, 1e-3, 4, "all", 1, 64, 0, False, False,
                                      options=opts)
        QwenEditTrainLoRA().start(model, data, "unconnected", 1, 1e-3, 4, "all", 1, 64, 0, False, False)
    assert [config.train.cpu_threads for config in started] == [1, 0, 0]
