"""Nothing silently wrong: bad settings refused before any weight loads, clear I/O errors, one writer per output
directory, non-finite guards, safetensors-only model directories."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from qwen_edit_core import QwenImageEditTrainer
from qwen_edit_core.cli import main
from qwen_edit_core.common.files import OutputDirBusyError, OutputLock, OutputWriteError, writing
from qwen_edit_core.config import to_dict
from qwen_edit_core.train.checkpoint import list_checkpoints

from conftest import train_config
from tolerances import TINY_TEXT_ENCODER_ROUNDINGS, TINY_VAE_ROUNDINGS, assert_close_fp32

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if any component would load (the checks must come first)."""
    import qwen_edit_core.api as api

    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the bad setting was reported")
    monkeypatch.setattr(api, "load_components", refuse)
    import qwen_edit_core.model.components as components
    monkeypatch.setattr(components, "load_components", refuse)


def _yaml(tmp_path, cfg):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _cli_cfg(model, data, out, cache, **train):
    return {"model": {"pretrained_model_name_or_path": str(model), "lora": {"rank": 4, "targets": "attn"}},
            "data": {"folder": str(data), "vae_area": 4096, "batch_size": 1}, "cache": {"dir": str(cache)},
            "train": {"output_dir": str(out), "max_steps": 2, **train}}


# --- preflight --------------------------------------------------------------------------------------------------

def test_cli_refuses_bad_steps_before_anything(tiny_edit_dir, pairs_dir, tmp_path, capsys, no_weights):
    path = _yaml(tmp_path, _cli_cfg(tiny_edit_dir, pairs_dir, tmp_path / "o", tmp_path / "cache", max_steps=-5))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "train.max_steps: -5 must be >= 1" in err and "Traceback" not in err


def test_resume_without_a_checkpoint_is_refused_before_weights(tiny_edit_dir, pairs_dir, tmp_path, no_weights):
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path / "o")
    with pytest.raises(FileNotFoundError, match=r"--resume: no complete checkpoint under '.*/o/checkpoints'"):
        QwenImageEditTrainer(config).fit(resume=True)
    with pytest.raises(FileNotFoundError, match=r"--resume '.*/elsewhere': no complete checkpoint there"):
        QwenImageEditTrainer(config).fit(resume=tmp_path / "elsewhere")


def test_nan_lora_to_continue_from_is_refused_before_weights(tiny_edit_dir, pairs_dir, tmp_path, no_weights):
    from safetensors.torch import save_file
    q = "transformer_blocks.0.attn.to_q"
    bad = tmp_path / "nan.safetensors"
    save_file({f"{q}.lora_A.weight": torch.full((4, 32), float("nan")), f"{q}.lora_B.weight": torch.zeros(32, 4)},
              bad)
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path / "o", model={
        "pretrained_model_name_or_path": str(tiny_edit_dir), "lora": {"rank": 4, "init_from": str(bad)}})
    with pytest.raises(ValueError, match="lora_A.weight' holds NaN or Inf"):
        QwenImageEditTrainer(config).fit()
    save_file({"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 3072),
               "transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(3072, 4)}, bad)
    with pytest.raises(ValueError, match=r"another model.*expected down \(r, 32\)"):
        QwenImageEditTrainer(config).fit()


def test_too_little_free_space_is_refused_before_weights(tiny_edit_dir, pairs_dir, tmp_path, monkeypatch,
                                                         no_weights):
    import qwen_edit_core.preflight as preflight
    monkeypatch.setattr(preflight, "free_bytes", lambda path: 100 << 10)
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path / "o")
    with pytest.raises(OutputWriteError, match=r"has 0.1 MiB free; training outputs need about 0\.\d MiB \(1 "
                                               r"checkpoint\(s\) of 0\.\d\d MiB at once plus 0\.\d\d MiB of LoRA"):
        QwenImageEditTrainer(config).fit()


@pytest.mark.parametrize("lora, train", [({"rank": 4}, {}), ({"rank": 16, "dora": True}, {"ema_decay": 0.9})])
def test_free_space_estimate_is_what_a_real_run_writes(tiny_edit_dir, pairs_dir, tmp_path, monkeypatch, lora, train):
    """The space asked for is the trained tensors' bytes plus small allowances: a real run's checkpoint and final
    files (LoRA, EMA LoRA, loss log and plot) fit in it, and it asks at most 1.5x what they take (the allowances
    of a tiny LoRA; a real-size one is ~1x). A run with just that much free is not refused."""
    import qwen_edit_core.preflight as preflight
    t = {"max_steps": 2, "checkpoint_every": 2, **train}
    model = {"pretrained_model_name_or_path": str(tiny_edit_dir), "lora": {"alpha": 4.0, "targets": "all", **lora}}
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path / "o", model=model, train=t)
    size = preflight.output_size(config, preflight.trained_tensors(config, tiny_edit_dir))
    result = QwenImageEditTrainer(config).fit()
    written = sum(f.stat().st_size for f in (tmp_path / "o" / "checkpoints").rglob("*") if f.is_file())
    finals = [result.lora_path, result.loss_plot, tmp_path / "o" / "loss.csv"]
    finals += [result.lora_path.with_name(result.lora_path.stem + "_ema.safetensors")] if train else []
    final = sum(f.stat().st_size for f in finals)
    assert size.checkpoints == 1 and written <= size.checkpoint <= 1.5 * written
    assert written + final <= size.total <= 1.5 * (written + final)
    monkeypatch.setattr(preflight, "free_bytes", lambda path: int(1.5 * (written + final)))
    QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "p", model=model, train=t)).check_fit()


def test_trained_tensors_are_estimated_inside_inference_mode(tmp_path, tiny_edit_dir, pairs_dir):
    """ComfyUI runs the Train node under torch.inference_mode(): the preflight's estimate works there too."""
    import qwen_edit_core.preflight as preflight
    model = {"pretrained_model_name_or_path": str(tiny_edit_dir), "lora": {"rank": 4, "targets": "attn"}}
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path / "o", model=model, train={"max_steps": 1})
    expected = preflight.trained_tensors(config, tiny_edit_dir)
    with torch.inference_mode():
        assert preflight.trained_tensors(config, tiny_edit_dir) == expected and expected


def test_preview_strings_report_every_problem_by_key(tmp_path):
    """Every problem of every --preview string at once, each naming the preview, the key and what is accepted:
    no Python error text, no type reprs, a strength that is not a number is not taken for part of a file name,
    a key given twice and an empty preview are errors, a missing LoRA file is named."""
    from qwen_edit_core.train.validation import parse_previews
    lora = tmp_path / "l.safetensors"
    lora.write_bytes(b"")
    with pytest.raises(ValueError) as err:
        parse_previews(["diffusers steps=abc", "diffusers cfg=nan steps=-2", f"lightning lora={lora}:abc",
                        "comfyui steps=3 steps=5", "", f"lightning lora={tmp_path / 'gone.safetensors'}:0.5",
                        "fast shift=0"])
    text = str(err.value)
    for expected in ("preview 1 'diffusers steps=abc': steps 'abc' is not a whole number >= 1",
                     "preview 2 'diffusers cfg=nan steps=-2': cfg 'nan' is not a finite number >= 0",
                     "preview 2 'diffusers cfg=nan steps=-2': steps '-2' is not a whole number >= 1",
                     "'abc' after the last ':' is not a strength (a finite number)",
                     "steps is given twice (steps=3 and steps=5)", "preview 5 '': empty",
                     f"lora '{tmp_path / 'gone.safetensors'}': no such file",
                     "the first word 'fast' is not a schedule; accepted: diffusers, comfyui, lightning",
                     "shift '0' is not a finite number > 0"):
        assert expected in text, text
    assert "invalid literal" not in text and "<class" not in text and "9 problem(s)" in text
    assert parse_previews([f"lightning steps=4 lora={lora}:0.5 label=fast_one"]) == [
        {"schedule": "lightning", "steps": 4, "loras": [{"path": str(lora), "strength": 0.5}], "label": "fast one"}]
    assert len(parse_previews("diffusers\n\nlightning")) == 2  # a text box: blank lines are no previews


def test_cli_preview_problems_come_before_any_weight_loads(tiny_edit_dir, pairs_dir, tmp_path, capsys, no_weights):
    cfg = _cli_cfg(tiny_edit_dir, pairs_dir, tmp_path / "o", tmp_path / "cache", validation_every=1,
                   validation_image=str(pairs_dir / "p0_control.png"), validation_prompt="x")
    path = _yaml(tmp_path, cfg)
    assert main(["train", str(path), "--preview", "lightning lora=missing.safetensors"]) == 2
    assert "lora 'missing.safetensors': no such file" in capsys.readouterr().err
    assert main(["train", str(path), "--preview", ""]) == 2
    assert "preview 1 '': empty" in capsys.readouterr().err
    # the same from the config file: every preview checked in the preflight, before the encoders load
    cfg["train"]["validation_previews"] = [{"schedule": "lightning", "loras": [{"path": "missing.safetensors"}]},
                                           {"schedule": "diffusers", "steps": 0}]
    assert main(["train", str(_yaml(tmp_path, cfg))]) == 2
    err = capsys.readouterr().err
    assert "validation_previews[0]: LoRA file 'missing.safetensors' does not exist" in err
    assert "validation_previews[1]: num_inference_steps must be >= 1" in err


def _refuses_new_files(folder: Path) -> bool:
    """True when `folder` is a folder in which even root cannot create a file (sysfs)."""
    try:
        (folder / "qwen-edit-probe").open("wb").close()
    except OSError:
        return folder.is_dir()
    (folder / "qwen-edit-probe").unlink()
    return False


#: a real folder where nobody, root included, can create files or folders (Linux sysfs)
SYSFS = Path("/sys/kernel")
needs_sysfs = pytest.mark.skipif(not _refuses_new_files(SYSFS), reason="needs Linux sysfs (no new files, even for "
                                                                       "root)")


@needs_sysfs
@pytest.mark.parametrize("command, key, place", [
    ("train", "train.output_dir", SYSFS), ("train", "train.output_dir", SYSFS / "qwen-edit-new" / "out"),
    ("train", "cache.dir", SYSFS), ("train", "cache.dir", SYSFS / "qwen-edit-new" / "cache"),
    ("cache", "cache.dir", SYSFS / "qwen-edit-new" / "cache")])
def test_an_unwritable_place_is_refused_naming_it_and_its_key_before_weights(tiny_edit_dir, pairs_dir, tmp_path,
                                                                             capsys, no_weights, command, key,
                                                                             place):
    out, cache = (place, tmp_path / "cache") if key == "train.output_dir" else (tmp_path / "o", place)
    path = _yaml(tmp_path, _cli_cfg(tiny_edit_dir, pairs_dir, out, cache))
    assert main([command, str(path)]) == 2
    err = capsys.readouterr().err
    assert "could not write " in err and f"to '{place}' ({key}): permission denied; choose a writable folder for " \
           f"{key}" in err, err
    assert "Traceback" not in err


def test_a_file_where_the_checkpoints_folder_goes_is_refused_before_weights(tiny_edit_dir, pairs_dir, tmp_path,
                                                                            no_weights):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "checkpoints").write_text("not a folder")
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path / "o")
    with pytest.raises(OutputWriteError, match=r"could not write checkpoints to '.*/o/checkpoints' "
                                               r"\(train.output_dir \(its checkpoints/\)\): a file of that name is "
                                               r"in the way \(not a folder\)"):
        QwenImageEditTrainer(config).fit()
    # held-out validation pairs write validation/ (metrics, pictures): probed the same way
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "validation").write_text("not a folder")
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path / "p",
                          train={"validation_every": 2, "validation_pairs": 1})
    with pytest.raises(OutputWriteError, match=r"could not write validation images to '.*/p/validation' "
                                               r"\(train.output_dir \(its validation/\)\): a file of that name"):
        QwenImageEditTrainer(config).fit()


_READ_ONLY_MOUNT = """
import sys
from qwen_edit_core.cli import main
code = main(["train", sys.argv[1]]), main(["train", sys.argv[2]]), main(["cache", sys.argv[3]])
print("exit codes", *code)
"""


def test_a_read_only_mount_is_refused_with_a_message_not_a_traceback(tiny_edit_dir, pairs_dir, tmp_path):
    """A tmpfs remounted read-only in a private mount namespace (EROFS, as a read-only volume gives)."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("needs unshare -m (root, or a kernel allowing private mount namespaces)")
    mount = tmp_path / "ro"
    mount.mkdir()
    configs = [_yaml(tmp_path / name, _cli_cfg(tiny_edit_dir, pairs_dir, out, cache)) for name, out, cache in (
        ("a", mount / "existing", tmp_path / "cache"), ("b", mount / "new" / "out", tmp_path / "cache"),
        ("c", tmp_path / "o", mount / "cache"))]
    script = (f"mount -t tmpfs -o size=1m tmpfs {mount} && mkdir {mount}/existing && mount -o remount,ro {mount} && "
              f"{sys.executable} -c '{_READ_ONLY_MOUNT}' {' '.join(map(str, configs))}")
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=env, timeout=300)
    if "mount:" in done.stderr and "exit codes" not in done.stdout:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    assert "exit codes 2 2 2" in done.stdout, done.stderr
    for place, key in ((mount / "existing", "train.output_dir"), (mount / "new" / "out", "train.output_dir"),
                       (mount / "cache", "cache.dir")):
        assert f"to '{place}' ({key}): the file system is read-only; choose a writable folder for {key}" \
               in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_missing_companion_lora_names_its_key_before_weights(tiny_edit_dir, pairs_dir, tmp_path, capsys,
                                                               no_weights):
    cfg = _cli_cfg(tiny_edit_dir, pairs_dir, tmp_path / "o", tmp_path / "cache")
    cfg["model"]["lora"]["stack"] = [{"path": str(tmp_path / "missing.safetensors"), "strength": 0.5}]
    assert main(["train", str(_yaml(tmp_path, cfg))]) == 2
    err = capsys.readouterr().err
    assert f"model.lora.stack[0]: LoRA file '{tmp_path / 'missing.safetensors'}' does not exist; give the path of " \
           "an existing LoRA file" in err


def test_over_long_captions_are_named_by_file_before_any_model_loads(tiny_edit_dir, pairs_dir, tmp_path, capsys,
                                                                     no_weights):
    from qwen_edit_core.model.components import caption_token_counter
    data = tmp_path / "data"
    shutil.copytree(pairs_dir, data)
    (data / "p1.txt").write_bytes(b"invert the colors " * 60_000)  # about 1 MB
    count = caption_token_counter(tiny_edit_dir)
    words = "invert the colors of the picture and "
    long = (words * int(1100 * 100 / count(words * 100) + 1)).strip()
    assert 1024 < count(long) < 1300
    (data / "p2.txt").write_text(long, encoding="utf-8")
    path = _yaml(tmp_path, _cli_cfg(tiny_edit_dir, data, tmp_path / "o", tmp_path / "cache"))
    for command in ("train", "cache"):
        assert main([command, str(path)]) == 2
        err = capsys.readouterr().err
        assert "2 problem(s) in dataset" in err and "Traceback" not in err
        assert f"{data / 'p1.txt'}: caption is 1080000 bytes, more than the text encoder's 1024 tokens" in err
        assert f"{data / 'p2.txt'}: caption is {count(long)} tokens; the text encoder takes at most 1024" in err


def test_cli_sample_checks_steps_and_loras_before_loading(tiny_edit_dir, pairs_dir, tmp_path, capsys, no_weights):
    args = ["sample", "--model", str(tiny_edit_dir), "--image", str(pairs_dir / "p0_control.png"), "--prompt", "x",
            "--out", str(tmp_path / "o.png")]
    assert main(args + ["--steps", "0"]) == 2
    assert "num_inference_steps must be >= 1" in capsys.readouterr().err
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    assert main(args + ["--lora", str(tmp_path / "junk.safetensors")]) == 2
    assert "not a readable safetensors" in capsys.readouterr().err
    assert main(args + ["--prompt", "word " * 300]) == 2  # over 1,024 tokens, counted by the tokenizer alone
    assert re.search(r"--prompt is \d{4} tokens; the text encoder takes at most 1024", capsys.readouterr().err)
    assert main(args + ["--negative-prompt", "word " * 300]) == 2
    assert "--negative-prompt is" in capsys.readouterr().err


def test_cli_sample_checks_the_control_images_before_loading(tiny_plus_dir, tiny_edit_dir, pairs_dir, tmp_path,
                                                             capsys, no_weights):
    from PIL import Image
    control = str(pairs_dir / "p0_control.png")
    args = ["sample", "--prompt", "x", "--out", str(tmp_path / "o.png")]
    assert main(args + ["--model", str(tiny_plus_dir)] + ["--image", control] * 4) == 2
    assert "a Qwen-Image-Edit-2509 (Edit Plus) model takes at most 3 control images, got 4; give at most 3" \
        in capsys.readouterr().err
    Image.new("RGB", (1, 1)).save(tmp_path / "dot.png")
    assert main(args + ["--model", str(tiny_edit_dir), "--image", str(tmp_path / "dot.png")]) == 2
    assert "control image 1 is 1x1, too small; accepted: at least 64 px on each side" in capsys.readouterr().err


def test_pairs_with_more_controls_than_the_model_takes_are_refused_before_weights(tiny_plus_dir, tmp_path,
                                                                                  no_weights):
    from conftest import make_pairs
    from qwen_edit_core.data.dataset import DatasetError
    data = make_pairs(tmp_path / "data", n=2)
    for k in range(1, 5):
        shutil.copy(data / "p0_control.png", data / f"p0_control_{k}.png")
    (data / "p0_control.png").unlink()
    config = train_config(tiny_plus_dir, data, tmp_path / "o")
    with pytest.raises(DatasetError, match=r"p0.png: has 4 control images; a Qwen-Image-Edit-2509 \(Edit Plus\) "
                                           r"model takes at most 3 control images"):
        QwenImageEditTrainer(config).check_fit()


def test_batch_larger_than_the_data_warns(tiny_edit_dir, pairs_dir, tmp_path, caplog):
    import logging
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path / "o", data={"batch_size": 8}, train={"max_steps": 1})
    with caplog.at_level(logging.WARNING, logger="qwen_edit_core.preflight"):
        QwenImageEditTrainer(config).check_fit()
    assert "data.batch_size 8 is larger than the dataset (4 samples)" in caplog.text
    caplog.clear()
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path / "p", data={"batch_size": 2}, train={"max_steps": 3000})
    with caplog.at_level(logging.WARNING, logger="qwen_edit_core.preflight"):
        QwenImageEditTrainer(config).check_fit()
    assert "train.max_steps 3000 is 1500 passes over 4 samples (more than 1000): check max_steps" in caplog.text


# --- clear I/O errors -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("code, reason", [(errno.ENOSPC, "the disk is full"), (errno.EROFS, "the file system is read-only"),
                                          (errno.EACCES, "permission denied")])
def test_io_errors_name_path_what_and_survivor(tmp_path, code, reason):
    with pytest.raises(OutputWriteError) as err:
        with writing(tmp_path / "x", "checkpoint step 4", "The checkpoint at step 2 is intact."):
            raise OSError(code, os.strerror(code))
    text = str(err.value)
    assert text.startswith(f"could not write checkpoint step 4 to {str(tmp_path / 'x')!r}: {reason}")
    assert text.endswith("The checkpoint at step 2 is intact.") and err.value.errno == code


def test_disk_full_during_a_checkpoint_names_it_and_resume_is_exact(tiny_edit_dir, pairs_dir, tmp_path,
                                                                    monkeypatch):
    """The kernel's own ENOSPC (writes to /dev/full) inside the second checkpoint's optimizer file."""
    import qwen_edit_core.train.checkpoint as ckpt
    real, calls = ckpt.torch.save, []

    def to_full_disk(obj, fh, *a, **k):
        calls.append(fh.name)
        if len(calls) == 3:
            with open("/dev/full", "wb") as full:
                return real(obj, full, *a, **k)
        return real(obj, fh, *a, **k)
    monkeypatch.setattr(ckpt.torch, "save", to_full_disk)
    out = tmp_path / "o"
    sections = {"train": {"max_steps": 6, "checkpoint_every": 2}}
    with pytest.raises(OutputWriteError) as err:
        QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, out, **sections)).fit()
    text = str(err.value)
    assert "could not write checkpoint step 4" in text and "the disk is full" in text
    assert "The checkpoint at step 2 is intact" in text and "--resume" in text
    monkeypatch.undo()
    assert [c.step for c in list_checkpoints(out / "checkpoints")] == [2]
    assert not list((out / "checkpoints").glob(".partial-*"))
    resumed = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, out, **sections)).fit(resume=True)
    full = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "full", **sections)).fit()
    a, b = load_file(resumed.lora_path), load_file(full.lora_path)
    assert all(torch.equal(a[k], b[k]) for k in a)


# --- one writer per output directory ------------------------------------------------------------------------

def test_a_second_run_on_the_same_output_dir_is_refused_at_once(tiny_edit_dir, pairs_dir, tmp_path, no_weights):
    out = tmp_path / "o"
    with OutputLock(out, purpose="training"):
        with pytest.raises(OutputDirBusyError) as err:
            QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, out)).fit()
    assert re.search(rf"PID {os.getpid()} on .*, training started \d{{4}}-\d\d-\d\dT", str(err.value))
    assert "choose another output directory" in str(err.value)


def test_a_background_job_holds_the_lock_and_a_second_is_refused(tiny_edit_dir, pairs_dir, tmp_path):
    from qwen_edit_core.jobs import JobRegistry
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path / "o", train={"max_steps": 1})
    with OutputLock(tmp_path / "o"):
        with pytest.raises(OutputDirBusyError):
            JobRegistry().start(config)
    registry = JobRegistry()
    job = registry.start(config)
    with pytest.raises(OutputDirBusyError):
        QwenImageEditTrainer(config).fit()
    assert job.wait().state == "done" and registry.running() == []
    OutputLock(tmp_path / "o").acquire().release()  # released when the job ended


def test_a_config_with_no_model_writes_nothing(pairs_dir, tmp_path):
    """A config that names no model (or one that does not exist) is refused before the output folder, its lock
    file included, is created: by the API, the CLI and a background job."""
    from qwen_edit_core.jobs import JobRegistry
    from qwen_edit_core.model.components import ModelNotFoundError
    out = tmp_path / "o"
    for model in ("", str(tmp_path / "missing")):
        config = train_config(model, pairs_dir, out)
        with pytest.raises(ModelNotFoundError, match="model"):
            QwenImageEditTrainer(config).fit()
        with pytest.raises(ModelNotFoundError, match="model"):
            JobRegistry().start(config)
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(to_dict(config)))
        assert main(["train", str(tmp_path / "c.yaml")]) == 2
        assert not out.exists()


_HOLDER = """
import sys
from qwen_edit_core.common.files import OutputLock
held = OutputLock(sys.argv[1], purpose="training").acquire()  # kept referenced: closing the file unlocks
print("locked", flush=True)
sys.stdin.readline()
"""


def test_sigkill_leaves_no_stale_lock(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_HOLDER), str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=TESTS.parent)
    assert proc.stdout.readline().strip() == "locked"
    with pytest.raises(OutputDirBusyError, match=f"PID {proc.pid} "):
        OutputLock(tmp_path).acquire()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    OutputLock(tmp_path).acquire().release()  # the kernel released it: no manual clean-up


# --- non-finite guards ----------------------------------------------------------------------------------------

def _nan_at(monkeypatch, steps):
    """flow_loss returns NaN (with a graph) at the given 1-based optimizer steps."""
    import qwen_edit_core.train.loop as loop
    real, seen = loop.flow_loss, []

    def flaky(model, batch, config, scheduler_config):
        loss, extra = real(model, batch, config, scheduler_config)
        seen.append(1)
        step = (len(seen) + 1) // 2 if config.train.gradient_accumulation_steps == 2 else len(seen)
        return (loss * float("nan") if step in steps else loss), extra
    monkeypatch.setattr(loop, "flow_loss", flaky)


def test_a_nan_loss_stops_training_naming_step_and_samples(tiny_edit_dir, pairs_dir, tmp_path, monkeypatch):
    _nan_at(monkeypatch, {3})
    out = tmp_path / "o"
    config = train_config(tiny_edit_dir, pairs_dir, out, train={"max_steps": 4, "checkpoint_every": 2})
    with pytest.raises(ValueError, match=r"the loss is nan at step 3 \(samples: p\d, p\d\); the checkpoint at "
                                         r"step 2 is intact"):
        QwenImageEditTrainer(config).fit()
    assert [c.step for c in list_checkpoints(out / "checkpoints")] == [2]
    assert not (out / "lora.safetensors").exists()


def test_nan_steps_are_skipped_up_to_the_limit(tiny_edit_dir, pairs_dir, tmp_path, monkeypatch, caplog):
    import logging
    _nan_at(monkeypatch, {2})
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path / "o", train={"max_steps": 3, "skip_nonfinite_steps": 1})
    with caplog.at_level(logging.WARNING, logger="qwen_edit_core.train.loop"):
        result = QwenImageEditTrainer(config).fit()
    assert result.state == "done" and result.step == 3 and "step skipped (1 of" in caplog.text
    weights = load_file(result.lora_path)
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())


# --- model directories hold safetensors only -----------------------------------------------------------------------

def test_a_bin_only_model_directory_is_refused_with_a_conversion_hint(tiny_edit_dir, tmp_path):
    from qwen_edit_core.model.components import ModelNotFoundError, load_transformer
    model = tmp_path / "model"
    shutil.copytree(tiny_edit_dir, model)
    folder = model / "transformer"
    for weights in folder.glob("*.safetensors"):
        torch.save(load_file(weights), folder / "diffusion_pytorch_model.bin")
        weights.unlink()
    for index in folder.glob("*.index.json"):
        index.unlink()
    with pytest.raises(ModelNotFoundError, match=r"transformer: .* holds only pickle-based weights "
                                                 r"\(diffusion_pytorch_model.bin\).*safe_serialization=True"):
        load_transformer(model, device=torch.device("cpu"), dtype=torch.float32)


def _damage(path: Path, how: str) -> None:
    """Damage a safetensors file as downloads and disks do."""
    from safetensors.torch import save_file
    data = path.read_bytes()
    if how == "huge header":
        path.write_bytes((2**50).to_bytes(8, "little") + data[8:])
    elif how == "no tensors":
        save_file({}, path)
    elif how == "truncated":
        path.write_bytes(data[: len(data) - 1000])
    elif how == "bad dtype":  # a header naming a dtype no reader knows (offsets stay valid)
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        header[min(k for k in header if k != "__metadata__")]["dtype"] = "Q99"
        raw = json.dumps(header).encode()
        path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])
    elif how == "wrong shape":  # a valid file whose first tensor has one more row than the config gives
        tensors = load_file(path)
        first = min(tensors)
        tensors[first] = torch.zeros(tensors[first].shape[0] + 1, *tensors[first].shape[1:])
        save_file(tensors, path)
    else:  # "missing tensor": a valid file lacking one tensor the model needs
        tensors = load_file(path)
        tensors.pop(sorted(tensors)[0])
        save_file(tensors, path)


@pytest.mark.parametrize("component, how, problem", [
    ("transformer", "huge header", r"its header claims 1125899906842624 bytes but the file has \d+"),
    ("transformer", "no tensors", r"it holds no tensors"),
    ("transformer", "truncated", r"it is truncated: its tensors need \d+ bytes, the file has \d+"),
    ("vae", "truncated", r"it is truncated"),
    ("text_encoder", "huge header", r"its header claims"),
    ("vae", "missing tensor", r"does not match its config.json: 1 tensor\(s\) the model needs are missing"),
    ("transformer", "missing tensor", r"does not match its config.json: 1 tensor\(s\) the model needs are missing"),
    ("transformer", "bad dtype", r"its header is not readable \(tensor '.*' has dtype 'Q99'; readable: "),
    ("vae", "wrong shape", r"1 tensor\(s\) have another shape than its config.json gives \(.* is \[\d+")])
def test_a_damaged_model_file_is_named_before_weights(tiny_edit_dir, pairs_dir, tmp_path, capsys, no_weights,
                                                      component, how, problem):
    model = tmp_path / "model"
    shutil.copytree(tiny_edit_dir, model)
    weights = next((model / component).glob("*.safetensors"))
    _damage(weights, how)
    path = _yaml(tmp_path, _cli_cfg(model, pairs_dir, tmp_path / "o", tmp_path / "cache"))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert re.search(problem, err) and str(weights) in err and "download the file again" in err, err
    assert "Traceback" not in err


def test_damaged_single_files_and_shards_are_named_before_weights(tiny_edit_dir, tmp_path):
    from qwen_edit_core import load_config
    from qwen_edit_core.model.single_file import SingleFileError  # noqa: F401 (the loaders' own error)
    from qwen_edit_core.model.weight_files import WeightFileError
    model = tmp_path / "model"
    shutil.copytree(tiny_edit_dir, model)
    single = tmp_path / "qwen_image_edit.safetensors"
    shutil.copy(next((model / "transformer").glob("*.safetensors")), single)
    _damage(single, "truncated")
    config = load_config(overrides={"model": {"pretrained_model_name_or_path": str(model),
                                              "transformer_file": str(single)}})
    with pytest.raises(WeightFileError, match=rf"transformer file '{re.escape(str(single))}' is damaged: it is "
                                              "truncated"):
        QwenImageEditTrainer(config).check_predict()
    with pytest.raises(WeightFileError, match="is damaged: it is truncated"):
        QwenImageEditTrainer(config).load_model(which=("transformer",))
    # a sharded text encoder whose index lists a tensor its shard lacks
    folder = model / "text_encoder"
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": {**{k: "model-00001-of-00001.safetensors" for k in tensors},
                                            "lm_head.extra": "model-00001-of-00001.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config = load_config(overrides={"model": {"pretrained_model_name_or_path": str(model)}})
    with pytest.raises(WeightFileError, match=r"text_encoder shard .* lacks 1 tensor\(s\) its index "
                                              r"model.safetensors.index.json lists \(e.g. \['lm_head.extra'\]\)"):
        QwenImageEditTrainer(config).check_predict()


# --- damaged cache data ------------------------------------------------------------------------------------------

def test_a_damaged_cache_entry_is_recomputed_before_training(tiny_edit_dir, pairs_dir, tmp_path):
    config = train_config(tiny_edit_dir, pairs_dir, tmp_path / "o")
    assert QwenImageEditTrainer(config).cache()["computed"] == 4
    entry = sorted((tmp_path / "o" / "cache").rglob("*.safetensors"))[0]
    good = load_file(entry)
    data = bytearray(entry.read_bytes())
    data[-200] ^= 0x10
    entry.write_bytes(bytes(data))
    stats = QwenImageEditTrainer(config).cache()
    again = load_file(entry)
    assert stats["computed"] == 1
    # encoded alone now, in a batch of four before: the encoders' sums in other kernels' order
    assert_close_fp32({k: v.float() for k, v in again.items()}, {k: v.float() for k, v in good.items()},
                      ops=max(TINY_VAE_ROUNDINGS, TINY_TEXT_ENCODER_ROUNDINGS), what="recomputed cache entry")
