"""The `qwen-edit` command answers `--help`, argument errors and config errors without importing torch,
diffusers, transformers, peft or accelerate (together seconds of imports): checked by the modules a fresh
interpreter holds afterwards, not by timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "diffusers", "transformers", "peft", "accelerate")

PROBE = """
import contextlib, io, json, sys
from qwen_edit_core import cli
err = io.StringIO()
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
    try:
        status = cli.main(json.loads(sys.argv[1]))
    except SystemExit as exit_:
        status = exit_.code
print(json.dumps({"status": status, "stderr": err.getvalue(), "modules": sorted(sys.modules)}))
"""


def run_cli(args: list[str], tmp_path: Path) -> dict:
    """`qwen-edit ARGS` in a fresh interpreter: exit status, stderr and the modules it imported."""
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], cwd=tmp_path, capture_output=True,
                         text=True, check=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout.splitlines()[-1])


def _bad_configs(tmp_path: Path) -> dict[str, str]:
    files = {"range.yaml": "train: {max_steps: -5}\n", "unknown.yaml": "train: {max_step: 5}\n",
             "yaml.yaml": "train: [\n", "env.yaml": "train: {output_dir: ${QWEN_EDIT_UNSET_VAR}/run}\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return files


@pytest.mark.parametrize("args, status", [
    (["--help"], 0), (["train", "--help"], 0), (["sample", "--help"], 0), (["nonsense"], 2),
    (["train"], 2), (["sample", "--model", "m"], 2), (["train", "missing.yaml"], 2), (["cache", "missing.yaml"], 2),
    (["train", "range.yaml"], 2), (["train", "unknown.yaml"], 2), (["cache", "yaml.yaml"], 2),
    (["train", "env.yaml"], 2), (["sample", "--model", "m", "--image", "i.png", "--prompt", "p", "--out", "o.png",
                                 "--config", "range.yaml"], 2)])
def test_help_and_argument_and_config_errors_import_no_heavy_library(tmp_path, args, status):
    _bad_configs(tmp_path)
    result = run_cli(args, tmp_path)
    assert result["status"] == status, result["stderr"]
    if status == 2 and args[0] != "nonsense":
        assert f"qwen-edit {args[0]}: error:" in result["stderr"], result["stderr"]
    loaded = [name for name in HEAVY if name in result["modules"]]
    assert not loaded, f"qwen-edit {' '.join(args)} imported {loaded}"


def test_the_scripting_api_still_exports_the_trainer():
    import qwen_edit_core
    from qwen_edit_core.api import QwenImageEditTrainer

    assert qwen_edit_core.QwenImageEditTrainer is QwenImageEditTrainer
    with pytest.raises(AttributeError):
        qwen_edit_core.NoSuchThing  # noqa: B018
