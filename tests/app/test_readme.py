"""The README's command blocks run as written (on the pretrained toy model), so they cannot drift.

Every `.venv/bin/qwen-edit ...` line of a top-level bash block runs in-process through the CLI's `main`, from the
repository root, with `/tmp/` redirected into the test's folder (also inside examples/tiny_train.yaml).
Left out: `demo` (tests/app/test_demo.py runs the same job with fewer steps) and `bench` (benchmarks
measure time; `qwen-edit bench` has its own smoke runs); `make` and `accelerate launch` are not qwen-edit lines.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from qwen_edit_core import cli

ROOT = Path(__file__).resolve().parents[2]
PREFIX = ".venv/bin/qwen-edit"
SKIPPED = {"demo", "bench"}


def readme_commands() -> list[list[str]]:
    """The argument lists of the README's qwen-edit lines, in order (continuation lines joined)."""
    commands = []
    # Top-level blocks only: a block indented inside a bullet illustrates an option with your own files.
    for block in re.findall(r"^```bash\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            args = shlex.split(line, comments=True)
            if args and args[0] == PREFIX:
                commands.append(args[1:])
    return commands


def test_the_readme_has_the_commands_a_user_needs():
    names = [args[0] for args in readme_commands() if args]
    for needed in ("tiny", "sample", "pairs", "cache", "train", "demo"):
        assert needed in names, f"README shows no `qwen-edit {needed}` command"


def test_readme_command_blocks_run_verbatim(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    config = tmp_path / "tiny_train.yaml"
    config.write_text((ROOT / "examples" / "tiny_train.yaml").read_text().replace("/tmp/", f"{tmp_path}/"))
    ran = []
    for args in readme_commands():
        if args[0] in SKIPPED:
            continue
        args = [str(config) if a == "examples/tiny_train.yaml" else a.replace("/tmp/", f"{tmp_path}/")
                for a in args]
        try:
            status = cli.main(args)
        except SystemExit as exit_:  # --help
            status = exit_.code
        assert status == 0, f"README command failed: qwen-edit {shlex.join(args)}"
        ran.append(args[0])
    assert {"tiny", "sample", "pairs", "cache", "train"} <= set(ran)
    assert (tmp_path / "out.png").is_file() and (tmp_path / "inverted.png").is_file()
    assert (tmp_path / "qwen-edit-run" / "qwen_edit_lora.safetensors").is_file()


@pytest.mark.parametrize("command, shown", [("demo", "(default: 300)"),
                                            ("pairs", "(default: 128)"), ("tiny", "(default: edit)")])
def test_help_shows_defaults(capsys, command, shown):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    assert shown in " ".join(capsys.readouterr().out.split())
