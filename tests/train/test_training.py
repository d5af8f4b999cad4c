"""Trainer behaviour users depend on: cached == realtime, inference mode, exact resume, crash safety, files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qwen_edit_core import QwenImageEditTrainer
from qwen_edit_core.train.checkpoint import list_checkpoints
from qwen_edit_core.cli import main
from qwen_edit_core.common.progress import CancelToken

from conftest import train_config
from tolerances import (TINY_FORWARD_ROUNDINGS, TINY_SAMPLER_ROUNDINGS, adam_trained_size, assert_close_fp32,
                        tiny_training_roundings)


def _lora(path):
    return load_file(path)


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_cached_and_realtime_give_the_same_losses_and_lora(tiny_edit_dir, pairs_dir, tmp_path):
    cached = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "c", train={"max_steps": 3})).fit()
    realtime = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "r",
                                                 cache={"enabled": False}, train={"max_steps": 3})).fit()
    assert [s for s, _ in cached.history] == [1, 2, 3]
    # the cache holds the float32 tensors the realtime path encodes: the same steps, bit for bit
    assert cached.history == realtime.history
    assert _max_diff(_lora(cached.lora_path), _lora(realtime.lora_path)) == 0


def test_training_from_the_cache_loads_no_encoder(tiny_edit_dir, pairs_dir, tmp_path, monkeypatch):
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path / "o", train={"max_steps": 1})
    trainer = QwenImageEditTrainer(config)
    trainer.cache()
    import qwen_edit_core.model.components as components
    loaded = []
    for name in ("load_text_encoder", "load_vae"):
        real = getattr(components, name)
        monkeypatch.setattr(components, name, lambda *a, _real=real, _n=name, **k: loaded.append(_n) or _real(*a, **k))
    result = trainer.fit()
    assert result.step == 1 and loaded == []


def test_fit_inside_inference_mode(tiny_edit_dir, pairs_dir, tmp_path):
    """ComfyUI calls nodes under torch.inference_mode(): training must still work."""
    with torch.inference_mode():
        result = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "o",
                                                   train={"max_steps": 2})).fit()
    assert result.state == "done" and result.step == 2
    assert all(torch.isfinite(torch.tensor(loss)) for _, loss in result.history)


def test_outputs_loss_csv_plot_checkpoints(tiny_edit_dir, pairs_dir, tmp_path):
    out = tmp_path / "o"
    result = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, out, train={
        "max_steps": 5, "checkpoint_every": 2, "keep_checkpoints": 2})).fit()
    rows = (out / "loss.csv").read_text().strip().splitlines()
    assert rows[0] == "step,loss" and len(rows) == 6
    assert (out / "loss.png").is_file() and result.loss_plot == out / "loss.png"
    assert [c.step for c in list_checkpoints(out / "checkpoints")] == [4, 5]
    metadata = json.loads((out / "checkpoints" / "step-0000005" / "state.json").read_text())
    assert metadata["step"] == 5


def test_stop_and_resume_equals_uninterrupted(tiny_edit_dir, pairs_dir, tmp_path):
    sections = {"train": {"max_steps": 6, "checkpoint_every": 2, "gradient_accumulation_steps": 2},
                "lr_scheduler": {"type": "cosine", "warmup_steps": 2},
                "data": {"caption_dropout_rate": 0.3, "prompt_image_dropout_rate": 0.2}}
    full = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "full", **sections)).fit()

    out = tmp_path / "stopped"
    token = CancelToken()

    def stop_at_3(event):
        if event.stage == "train" and event.step == 3:
            token.cancel()

    config = train_config(tiny_edit_dir, pairs_dir, out, **sections)
    stopped = QwenImageEditTrainer(config).fit(progress=stop_at_3, cancel=token)
    assert stopped.state == "cancelled" and stopped.step == 3
    resumed = QwenImageEditTrainer(config).fit(resume=True)
    assert resumed.state == "done" and resumed.step == 6
    assert _max_diff(_lora(full.lora_path), _lora(resumed.lora_path)) == 0  # the same steps, bit for bit
    assert [s for s, _ in resumed.history] == [1, 2, 3, 4, 5, 6]


def test_a_checkpoint_with_a_lora_on_the_discarded_text_output_resumes_exactly(tiny_edit_dir, pairs_dir, tmp_path,
                                                                                monkeypatch):
    """A checkpoint written while the LoRA also sat on the last block's text output (which reaches no loss, so
    `inject_lora` now leaves it out) resumes: its optimizer state loads without those tensors and the run goes on
    as the older run did, bit for bit (no gradient ever reached those layers: their B stayed zero)."""
    from qwen_edit_core.adapters import lora
    with monkeypatch.context() as patch:
        patch.setattr(lora, "unreached_modules", lambda model: frozenset())  # the older injection
        older = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "older",
                                                  train={"checkpoint_every": 2})).fit()
    resumed = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "new",
                                                cache_dir=tmp_path / "older" / "cache")).fit(
        resume=tmp_path / "older" / "checkpoints" / "step-0000002")
    assert resumed.step == 4
    old, new = _lora(older.lora_path), _lora(resumed.lora_path)
    extra = set(old) - set(new)
    assert extra and set(new) < set(old) and all(".transformer_blocks.1." in k and (".to_add_out." in k or
                                                  ".txt_mlp." in k) for k in extra), sorted(extra)
    assert all(not old[k].any() for k in extra if ".lora_up." in k)
    assert _max_diff({k: old[k] for k in new}, new) == 0


def test_cli_train_and_resume_with_path(tiny_edit_dir, pairs_dir, tmp_path):
    import yaml
    out = tmp_path / "o"
    cfg = {"model": {"pretrained_model_name_or_path": str(tiny_edit_dir), "lora": {"rank": 4, "targets": "attn"}},
           "data": {"folder": str(pairs_dir), "vae_area": 4096, "batch_size": 1},
           "cache": {"dir": str(tmp_path / "cache")},
           "train": {"output_dir": str(out), "max_steps": 2, "checkpoint_every": 1}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path)]) == 0
    cfg["train"]["max_steps"] = 3
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path), "--resume", str(out / "checkpoints" / "step-0000002")]) == 0
    assert (out / "lora.safetensors").is_file()
    assert [c.step for c in list_checkpoints(out / "checkpoints")][-1] == 3


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import qwen_edit_core.train.checkpoint as ckpt
    from conftest import train_config
    from qwen_edit_core import QwenImageEditTrainer
    real_save, calls = ckpt.torch.save, []
    def dying_save(obj, path, *a, **k):
        calls.append(path)
        if len(calls) == 3:  # the second checkpoint's optimizer file: die half-way through writing it
            path.write(b"partial")  # an open file: checkpoints write through Python files
            path.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(obj, path, *a, **k)
    ckpt.torch.save = dying_save
    from pathlib import Path
    config = train_config(Path({model!r}), Path({data!r}), Path({out!r}), train={{"max_steps": 6,
                          "checkpoint_every": 2}})
    QwenImageEditTrainer(config).fit()
""")


def test_sigkill_while_writing_a_checkpoint_resumes_from_the_previous(tiny_edit_dir, pairs_dir, tmp_path):
    out = tmp_path / "killed"
    script = KILL_SCRIPT.format(tests=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), model=str(tiny_edit_dir), data=str(pairs_dir),
                                out=str(out))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert [c.step for c in list_checkpoints(out / "checkpoints")] == [2]
    config = train_config(tiny_edit_dir, pairs_dir, out, train={"max_steps": 6, "checkpoint_every": 2})
    resumed = QwenImageEditTrainer(config).fit(resume=True)
    full = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "full",
                                             train={"max_steps": 6, "checkpoint_every": 2})).fit()
    assert resumed.step == 6
    assert _max_diff(_lora(full.lora_path), _lora(resumed.lora_path)) == 0  # the same steps, bit for bit
    assert not list((out / "checkpoints").glob(".partial-*"))


def _entries(root) -> dict:
    """Every file under `root` by relative path: a safetensors file as its metadata and each tensor's bytes (the
    library writes the metadata's keys in a per-process hash order), a JSON file parsed, any other as its bytes."""
    from safetensors import safe_open

    def content(path: Path):
        if path.suffix == ".safetensors":
            with safe_open(path, "pt") as f:
                return f.metadata(), {k: f.get_tensor(k).numpy().tobytes() for k in f.keys()}
        return json.loads(path.read_text()) if path.suffix == ".json" else path.read_bytes()
    return {str(p.relative_to(root)): content(p) for p in sorted(Path(root).rglob("*")) if p.is_file()}


@pytest.mark.slow  # accelerate launch: several processes
def test_accelerate_two_processes_equal_one_process(tiny_edit_dir, pairs_dir, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` on the CPU (two processes: `--cpu` would start one)
    gives the LoRA of one process with the same global batch (2), within float32 rounding (the gradient
    all-reduce sums in another order), with an fp8 base (its frozen weights are buffers, which DDP must not broadcast)."""
    import yaml
    cfg = {"model": {"pretrained_model_name_or_path": str(tiny_edit_dir),
                     "lora": {"rank": 4, "alpha": 4.0, "targets": "all"}},
           "data": {"folder": str(pairs_dir), "vae_area": 4096, "batch_size": 2},
           "cache": {"dir": str(tmp_path / "cache")},
           "train": {"output_dir": str(tmp_path / "ddp"), "max_steps": 3, "seed": 3, "fp8_base": True},
           "optimizer": {"lr": 1e-3}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "qwen_edit_core.cli",
                           "train", str(path)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training on 2 processes (data parallel)" in proc.stderr, proc.stderr[-3000:]
    # the fresh cache was shared out: each process encoded its half, and the result is one process's cache
    assert "process 0 of 2 encodes" in proc.stderr and "process 1 of 2 encodes" in proc.stderr, proc.stderr[-3000:]
    single = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "one",
                                               cache_dir=tmp_path / "c1",
                                               train={"max_steps": 3, "fp8_base": True})).fit()
    assert _entries(tmp_path / "cache") == _entries(tmp_path / "c1")
    # the processes' forwards (one pair each) and the gradient all-reduce round differently from one process's
    # batch of two: three steps' rounding and one more for the average, magnified by Adam (adam_trained_size)
    expected = _lora(single.lora_path)
    assert_close_fp32(_lora(tmp_path / "ddp" / "lora.safetensors"), expected, ops=tiny_training_roundings(3) + 1,
                      size=adam_trained_size(expected, lr=1e-3), what="LoRA of 2 processes vs one")


@pytest.mark.slow  # accelerate launch: several processes
def test_accelerate_launch_starts_one_process_with_cpu_and_the_check_tells_them_apart(tmp_path):
    """`accelerate launch --num_processes 2 --cpu` runs the script once, `--multi_gpu` twice: the one process of
    the first sees the launcher's variables of a multi-process launch and no WORLD_SIZE, and `launch_mismatch`
    says so for it alone (the variables `test_a_multi_process_launch_that_started_one_process_says_so` sets)."""
    from qwen_edit_core.train.distributed import launch_mismatch
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    script = tmp_path / "env.py"  # each process writes its environment to a file of its own
    script.write_text("import json, os, sys; open(os.path.join(sys.argv[1], f'{os.getpid()}.json'), 'w').write("
                      "json.dumps(dict(os.environ)))")
    runs = {}
    for flags in (["--cpu"], ["--multi_gpu"]):
        out = tmp_path / flags[0].strip("-")
        out.mkdir()
        proc = subprocess.run([accelerate, "launch", *flags, "--num_processes", "2", "--num_machines", "1",
                               "--mixed_precision", "no", "--dynamo_backend", "no", str(script), str(out)],
                              capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[flags[0]] = [json.loads(f.read_text()) for f in sorted(out.glob("*.json"))]
    assert len(runs["--cpu"]) == 1 and len(runs["--multi_gpu"]) == 2  # what accelerate really starts
    assert "--multi_gpu --num_processes N" in launch_mismatch(runs["--cpu"][0])
    assert {k: runs["--cpu"][0].get(k) for k in ("ACCELERATE_MIXED_PRECISION", "WORLD_SIZE")} == \
        {"ACCELERATE_MIXED_PRECISION": "no", "WORLD_SIZE": None} and "MASTER_ADDR" in runs["--cpu"][0]
    assert all(launch_mismatch(env) is None for env in runs["--multi_gpu"])


def test_a_multi_process_launch_that_started_one_process_says_so(tiny_edit_dir, pairs_dir, tmp_path, monkeypatch,
                                                                 caplog):
    """A process started by accelerate's plain launcher for `--num_processes 2` (its variables: the mixed
    precision and a rendezvous address, no WORLD_SIZE; the slow test above records them from the real launcher)
    warns before any weight loads, naming the launch that works on the CPU; a launch outside accelerate does not."""
    import logging
    from qwen_edit_core.train.distributed import launch_mismatch
    assert launch_mismatch({}) is None  # not launched by accelerate
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for key, value in (("ACCELERATE_MIXED_PRECISION", "no"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(key, value)
    with caplog.at_level(logging.WARNING, logger="qwen_edit_core.preflight"):
        QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "o")).check_fit()
    assert "started only this one" in caplog.text and "--multi_gpu --num_processes N" in caplog.text


@pytest.mark.parametrize("cached", [True, False])
def test_validation_images_every_n_steps(tiny_edit_dir, pairs_dir, tmp_path, cached, monkeypatch):
    from qwen_edit_core.train import loop
    walks, real = [], loop.run_storages
    monkeypatch.setattr(loop, "run_storages", lambda *a: walks.append(1) or real(*a))
    out = tmp_path / "o"
    config = train_config(tiny_edit_dir, pairs_dir, out, cache={"enabled": cached}, train={
        "max_steps": 4, "validation_every": 2, "validation_steps": 2, "checkpoint_every": 3,
        "validation_image": str(pairs_dir / "p0_control.png"), "validation_prompt": "invert the colors"})
    events, held = [], []

    def keep(event):  # a ledger's consumer reads what the run holds during the event
        events.append(event)
        if event.stage == "train":
            held.append(sum(event.device_storages().values()))
    result = QwenImageEditTrainer(config).fit(progress=keep)
    assert [p.name for p in result.validation_images] == ["step-0000002.png", "step-0000004.png"]
    assert all(p.is_file() for p in result.validation_images)
    # every file the run writes is reported as it is written (the job's live view shows only its own run's)
    written = [(e.stage, e.step, e.path) for e in events if e.stage in ("checkpoint", "validation")]
    assert written == [("validation", 2, out / "validation" / "step-0000002.safetensors"),
                       ("checkpoint", 3, out / "checkpoints" / "step-0000003"),
                       ("validation", 4, out / "validation" / "step-0000004.safetensors"),
                       ("checkpoint", 4, out / "checkpoints" / "step-0000004")]
    # the run says when it is about to use its device (a step, a validation) and what it holds there after a step
    assert [(e.stage, e.step) for e in events if e.stage in ("device", "train")] == [
        ("device", 1), ("train", 1), ("device", 2), ("train", 2), ("device", 2), ("device", 3), ("train", 3),
        ("device", 4), ("train", 4), ("device", 4), ("device", 4)]
    # ... as a reader: the run never walks the storages itself, only a consumer that asks (a ledger's) does
    assert len(walks) == len(held) == 4 and all(n > 0 for n in held)


def test_kept_progress_events_keep_neither_the_model_nor_the_optimizer(tiny_edit_dir, pairs_dir, tmp_path,
                                                                     monkeypatch):
    """A consumer that keeps the "train" events after the run (this test, a log) keeps no optimizer state or
    model alive: the events' storages reader holds them weakly."""
    import gc
    import weakref
    from qwen_edit_core.train import loop
    optimizers, real = [], loop.make_optimizer
    monkeypatch.setattr(loop, "make_optimizer", lambda *a: optimizers.append(weakref.ref(opt := real(*a))) or opt)
    events = []
    trainer = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "o", train={"max_steps": 1}))
    trainer.fit(progress=events.append)
    del trainer
    gc.collect()
    assert len(optimizers) == 1 and optimizers[0]() is None
    assert [e.device_storages() for e in events if e.stage == "train"] == [{}]


def test_the_run_lets_go_of_its_hold_before_the_validation_pictures_decode(tiny_edit_dir, pairs_dir, tmp_path,
                                                                         monkeypatch):
    """After its last step the run says it uses its device again, before it decodes the validation latents (or
    gives back a lent model): the caller's hold for a next step must not sit beside the VAE."""
    from qwen_edit_core.train import run as run_mod
    events = []
    real = run_mod._with_validation
    monkeypatch.setattr(run_mod, "_with_validation", lambda *a: events.append("decode") or real(*a))
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path / "o", train={"max_steps": 1})
    QwenImageEditTrainer(config).fit(progress=events.append)
    order = [e if e == "decode" else (e.stage, e.step) for e in events if e == "decode" or e.stage in ("device", "train")]
    assert order == [("device", 1), ("train", 1), ("device", 1), "decode"]


def test_training_step_dispatches_by_content(tiny_edit_dir, pairs_dir, tmp_path):
    """Cached tensors and raw examples give the same loss for the same batch and seed."""
    from qwen_edit_core.data.example_tensors import cache_key, encoder_identity
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path / "o")
    trainer = QwenImageEditTrainer(config)
    examples = list(trainer.dataset().examples[:2])
    trainer.cache(examples)
    settings = trainer.encode_settings("edit")
    cached = [trainer._cache().get(cache_key(e, settings, encoder_identity(tiny_edit_dir))) for e in examples]
    trainer.load_model()
    assert trainer.training_step(cached, step=3).item() == trainer.training_step(examples, step=3).item()


def test_gradient_checkpointing_gives_the_same_training(tiny_edit_dir, pairs_dir, tmp_path):
    plain = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "a",
                                              train={"max_steps": 2})).fit()
    ckpt_run = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "b", train={
        "max_steps": 2, "gradient_checkpointing": True})).fit()
    # recomputing the blocks runs their forward again with the same kernels: the same gradients
    assert _max_diff(_lora(plain.lora_path), _lora(ckpt_run.lora_path)) == 0


@pytest.mark.parametrize("signame, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_saves_a_checkpoint_and_exits_128_plus_its_number(tiny_edit_dir, pairs_dir, tmp_path, signame, code):
    """Ctrl-C (SIGINT) and SIGTERM (docker stop, timeout, Slurm, systemd) both stop `qwen-edit train` at a step
    boundary with a checkpoint, exit 128 + the signal's number and say how to continue."""
    import re
    import signal

    import yaml
    out = tmp_path / "o"
    cfg = {"model": {"pretrained_model_name_or_path": str(tiny_edit_dir)},
           "data": {"folder": str(pairs_dir), "vae_area": 4096},
           "cache": {"dir": str(tmp_path / "cache")},
           "train": {"output_dir": str(out), "max_steps": 100000}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    qwen_edit = os.path.join(os.path.dirname(sys.executable), "qwen-edit")
    proc = subprocess.Popen([qwen_edit, "train", str(path)], stderr=subprocess.PIPE,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    # Synchronise on the run's own progress output (blocking reads, no polling): the signal once step 3 is done.
    seen = ""
    while not any(int(n) >= 3 for n in re.findall(r"(\d+)/100000", seen)):
        chunk = os.read(proc.stderr.fileno(), 4096).decode(errors="replace")
        assert chunk, f"training ended before step 3: {seen[-2000:]}"
        seen += chunk
    proc.send_signal(getattr(signal, signame))
    _, rest = proc.communicate(timeout=120)
    err = seen + rest.decode(errors="replace")
    assert proc.returncode == code, err[-2000:]
    saved = list_checkpoints(out / "checkpoints")
    assert len(saved) == 1 and saved[0].step >= 3
    assert f"{signame}: stopped (the checkpoint of step {saved[0].step} is saved; continue with --resume)" in err


def test_a_signal_before_training_says_nothing_was_saved(tiny_edit_dir, pairs_dir, tmp_path, caplog, monkeypatch):
    """A signal while the run loads or caches (here: as the run starts) stops it at once through the CLI's
    signal handler, exits 128 + its number, and does not claim a checkpoint it never wrote."""
    import logging
    import signal

    import qwen_edit_core.api as api

    def fit(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)  # handled inside os.kill: the handler raises here
        raise AssertionError("SIGTERM before training did not stop the run at once")
    monkeypatch.setattr(api.QwenImageEditTrainer, "fit", fit)
    before = signal.getsignal(signal.SIGTERM)
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {{pretrained_model_name_or_path: {tiny_edit_dir}}}\ndata: {{folder: {pairs_dir}}}\n"
                    f"train: {{output_dir: {tmp_path / 'o'}}}\n")
    with caplog.at_level(logging.ERROR, logger="qwen_edit_core.cli"):
        assert main(["train", str(path)]) == 143
    assert "SIGTERM: stopped (before any training step: no checkpoint was needed" in caplog.text
    assert "is saved" not in caplog.text
    assert signal.getsignal(signal.SIGTERM) is before  # the previous handler is back


def _mixed_pairs(folder, controls=1):
    """Folder layout, three sizes, captions of different lengths, `controls` control images each."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(7)
    (folder / "images").mkdir(parents=True)
    dirs = [folder / f"control_{k + 1}" for k in range(controls)]
    for d in dirs:
        d.mkdir()
    sizes = [(64, 64), (96, 64), (64, 96), (64, 64), (96, 64), (64, 96)]
    for i, (w, h) in enumerate(sizes):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / "images" / f"s{i}.png")
        for k, d in enumerate(dirs):
            cw, ch = (w, h) if k == 0 else (h, w)
            Image.fromarray(rng.integers(0, 255, (ch, cw, 3), dtype=np.uint8)).save(d / f"s{i}.png")
        (folder / "images" / f"s{i}.txt").write_text("make it " + "very " * i + "blue")
    return folder


def test_mixed_size_batch_loss_is_the_mean_of_one_by_one(tiny_edit_dir, tmp_path):
    from qwen_edit_core.adapters import multires as batching
    from qwen_edit_core.data.example_tensors import cache_key, encoder_identity
    from qwen_edit_core.train.loop import collate, flow_loss, sample_generator
    data = _mixed_pairs(tmp_path / "mixed")
    config = train_config(tiny_edit_dir, data, tmp_path / "o", data={"vae_area": 80 * 80})
    trainer = QwenImageEditTrainer(config)
    examples = list(trainer.dataset().examples[:3])
    trainer.cache(examples)
    settings = trainer.encode_settings("edit")
    items = [trainer._cache().get(cache_key(e, settings, encoder_identity(tiny_edit_dir))) for e in examples]
    assert len({tuple(map(tuple, i["img_shapes"].tolist())) for i in items}) == 3
    trainer.load_model(which=("transformer",))
    model = trainer.components.transformer
    batching.install(model)
    gens = lambda: [sample_generator(1, 0, 0, j) for j in range(3)]  # noqa: E731
    kw = dict(caption_dropout=0.0, control_dropout=0.0, device=torch.device("cpu"), dtype=torch.float32)
    with torch.no_grad():
        loss, per_sample = flow_loss(model, collate(items, gens(), **kw), config, trainer.components.scheduler_config)
        alone = [flow_loss(model, collate([item], [g], **kw), config, trainer.components.scheduler_config)[0]
                 for item, g in zip(items, gens())]
    # one call per layout instead of one per sample: other kernels' sums, a forward's roundings (doubled by the
    # squared error)
    alone = torch.stack(alone)
    assert_close_fp32(per_sample, alone, ops=2 * TINY_FORWARD_ROUNDINGS, what="per-sample losses batched vs alone")
    assert_close_fp32(loss, alone.mean(), ops=2 * TINY_FORWARD_ROUNDINGS + 3, what="batch loss vs alone")


def test_similar_grouping_trains_mixed_batches_and_logs_padding(tiny_edit_dir, tmp_path, caplog):
    import logging
    data = _mixed_pairs(tmp_path / "mixed")
    config = train_config(tiny_edit_dir, data, tmp_path / "o", data={"vae_area": 80 * 80, "batch_size": 3,
                                                                     "bucket_grouping": "similar"},
                          train={"max_steps": 3})
    with caplog.at_level(logging.INFO, logger="qwen_edit_core.train.distributed"):
        result = QwenImageEditTrainer(config).fit()
    assert result.step == 3 and all(torch.isfinite(torch.tensor(v)) for _, v in result.history)
    assert any("were padding" in r.message for r in caplog.records)


def test_edit_plus_training_with_two_controls(tiny_plus_dir, tmp_path):
    from safetensors.torch import load_file as load
    data = _mixed_pairs(tmp_path / "plus", controls=2)
    config = train_config(tiny_plus_dir, data, tmp_path / "o", data={"vae_area": 80 * 80, "vl_area": 64 * 64,
                                                                     "batch_size": 2, "bucket_grouping": "similar"},
                          train={"max_steps": 2})
    result = QwenImageEditTrainer(config).fit()
    assert result.step == 2
    entry = next((tmp_path / "o" / "cache").rglob("*.safetensors"))
    tensors = load(entry)
    assert {"control_latents_0", "control_latents_1"} <= set(tensors) and tensors["img_shapes"].shape == (3, 3)


def test_bf16_mixed_precision_on_cpu(tiny_edit_dir, pairs_dir, tmp_path):
    result = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "o", train={
        "max_steps": 2, "mixed_precision": "bf16"}, lr_scheduler={"type": "linear", "warmup_steps": 1})).fit()
    assert result.step == 2 and all(torch.isfinite(torch.tensor(v)) for _, v in result.history)


@pytest.mark.parametrize("section, values, message", [
    ("optimizer", {"type": "adamw8bit"}, "CUDA"),
    ("optimizer", {"type": "sgd"}, "accepted: adamw, adamw8bit"),
    ("lr_scheduler", {"type": "exponential"}, "lr_scheduler.type"),
    ("train", {"mixed_precision": "fp8"}, "mixed_precision"),
    ("train", {"timestep_sampling": "beta"}, "timestep_sampling"),
])
def test_bad_training_options_are_named(tiny_edit_dir, pairs_dir, tmp_path, section, values, message):
    sections = {section: values}
    sections["train"] = {"max_steps": 1, **sections.get("train", {})}
    with pytest.raises(ValueError, match=message):  # at load (typed config) or at the start of training
        QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "o", **sections)).fit()


def test_facade_lora_save_load_merge(tiny_edit_dir, pairs_dir, tmp_path):
    import numpy as np
    from PIL import Image
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path / "o", train={"max_steps": 3},
                          predict={"vae_area": 64 * 64})
    trainer = QwenImageEditTrainer(config)
    trainer.fit()
    trainer.load_model(which=("vae", "text_encoder"), keep_transformer=True)
    saved = trainer.save_lora(tmp_path / "mine.safetensors")
    image = Image.open(pairs_dir / "p0_control.png")
    with_lora = trainer.predict(image, "invert the colors", num_inference_steps=2, seed=0)
    trainer.merge_lora()
    merged = trainer.predict(image, "invert the colors", num_inference_steps=2, seed=0)
    trainer.unmerge_lora()
    # the LoRA merged into the weights instead of beside them: another order, a sampler run's roundings
    assert_close_fp32(torch.from_numpy(merged), torch.from_numpy(with_lora), ops=TINY_SAMPLER_ROUNDINGS,
                      what="picture with the LoRA merged")

    fresh = QwenImageEditTrainer(config)
    fresh.load_model()
    plain = fresh.predict(image, "invert the colors", num_inference_steps=2, seed=0)
    fresh.load_lora(saved, scale=1.0)
    reloaded = fresh.predict(image, "invert the colors", num_inference_steps=2, seed=0)
    assert_close_fp32(torch.from_numpy(reloaded), torch.from_numpy(with_lora), ops=TINY_SAMPLER_ROUNDINGS,
                      what="picture with the LoRA reloaded from its file")
    assert np.abs(plain - with_lora).max() > 1e-4  # and the LoRA does something


def test_continue_training_from_a_lora_file(tiny_edit_dir, pairs_dir, tmp_path):
    """model.lora.init_from starts the adapter from a file: with a zero learning rate the run saves it back."""
    first = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "a",
                                              train={"max_steps": 3})).fit()
    again = QwenImageEditTrainer(train_config(
        tiny_edit_dir, pairs_dir, tmp_path / "b", train={"max_steps": 1},
        model={"lora": {"rank": 4, "alpha": 4.0, "targets": "all", "init_from": str(first.lora_path)}},
        optimizer={"lr": 1e-30})).fit()  # lr must be > 0: 1e-30 moves no weight measurably
    # an Adam step moves a weight by at most lr = 1e-30, far under half an ulp of any trained weight
    assert _max_diff(_lora(first.lora_path), _lora(again.lora_path)) == 0
