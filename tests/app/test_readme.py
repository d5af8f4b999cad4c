"""The command blocks of README.md and docs/*.md run as written, in reading order, so they cannot drift.

The pages are read in the order a user meets them (README.md, then `DOC_ORDER`, then any other docs/ page by
name, then BENCHMARKS.md, the speed reference the README links). Blocks fenced `bash` run line by line from the
repository root with `HOME` in the test's folder (so the README's `export WORK=$HOME/...` writes there):
`export` sets the variable, `.venv/bin/qwen-edit ...` runs in-process through the CLI's `main` (variables
expanded as the shell would). Blocks fenced `python` run
in-process in one namespace per block. Left out, each for a stated reason:

- `make ...` lines: `make demo` is what the pages assume was run first (tests/app/test_demo.py runs the same
  job with fewer steps) and `make test` is this suite;
- `qwen-edit demo` (the same) and `qwen-edit bench` (benchmarks measure time; they have their own smoke runs);
- blocks fenced `console` (shell) or `py` (Python): those need a GPU, several processes, a ComfyUI checkout
  or a long build; the page says so in the sentence before the block (checked here).
"""

from __future__ import annotations

import inspect
import os
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from qwen_edit_core import cli

from conftest import KEEPS_THE_SHAPES

ROOT = Path(__file__).resolve().parents[2]
PREFIX = ".venv/bin/qwen-edit"
SKIPPED = {"demo", "bench"}
RUN = {"bash", "python"}
NOT_RUN = {"console", "py"}
#: how a command line starts (a fence without a language must hold none: diagrams and file trees only)
COMMAND_STARTS = (".venv/", "qwen-edit ", "python ", "make ", "accelerate ", "torchrun ", "bash ", "from qwen_edit_core",
                  "import qwen_edit_core")
#: the docs/ pages in reading order (each may use what an earlier one made); others follow by name
DOC_ORDER = ("TRAINING.md", "SAMPLING.md", "COMFYUI.md", "MEMORY.md", "GUARANTEES.md", "TOY_MODEL.md")
FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```", flags=re.S | re.M)


def pages() -> list[Path]:
    """README.md, then the docs/ pages in reading order, then BENCHMARKS.md."""
    docs = sorted((ROOT / "docs").glob("*.md"), key=lambda p: (p.name not in DOC_ORDER,
                                                               DOC_ORDER.index(p.name) if p.name in DOC_ORDER else 0,
                                                               p.name))
    return [ROOT / "README.md", *docs, ROOT / "BENCHMARKS.md"]


def blocks(page: Path) -> list[tuple[str, str, str]]:
    """(language, code, the text before the block) of each fenced block of a page, in order."""
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        indent, language, body = match.groups()
        code = "\n".join(line[len(indent):] for line in body.splitlines())
        found.append((language, code, text[max(0, match.start() - 400):match.start()]))
    return found


def shell_commands(code: str) -> list[list[str]]:
    """The argument lists of a bash block's lines (continuation lines joined, comments dropped)."""
    return [args for line in code.replace("\\\n", " ").splitlines() if (args := shlex.split(line, comments=True))]


def run_shell_line(args: list[str], monkeypatch) -> None:
    """One line of a `bash` block, as the shell would run it (see the module docstring for what is left out)."""
    if args[0] == "make":
        return
    if args[0] == "export":
        for assignment in args[1:]:
            name, _, value = assignment.partition("=")
            monkeypatch.setenv(name, os.path.expandvars(value))
        return
    assert args[0] == PREFIX, f"a bash block runs {args[0]!r}: only {PREFIX}, export and make lines are run " \
                              "here; fence the block as `console` with the reason it is not run, or extend this test"
    args = [os.path.expandvars(a) for a in args[1:]]
    if args[0] in SKIPPED:
        return
    try:
        status = cli.main(args)
    except SystemExit as exit_:  # --help
        status = exit_.code
    assert status == 0, f"command failed: qwen-edit {shlex.join(args)}"


def readme_prompt(out_name: str) -> str:
    """The --prompt of the README's `qwen-edit sample` command that writes `out_name`."""
    for language, code, _ in blocks(ROOT / "README.md"):
        for args in shell_commands(code) if language == "bash" else []:
            if args[:2] == [PREFIX, "sample"] and args[args.index("--out") + 1].endswith(out_name):
                return args[args.index("--prompt") + 1]
    raise AssertionError(f"the README samples no {out_name}")


def test_the_readme_has_the_commands_a_user_needs():
    names = [args[1] for language, code, _ in blocks(ROOT / "README.md") if language == "bash"
             for args in shell_commands(code) if args[0] == PREFIX]
    for needed in ("tiny", "sample", "pairs", "cache", "train"):
        assert needed in names, f"README shows no `qwen-edit {needed}` command"
    assert len((ROOT / "README.md").read_text().splitlines()) <= 160, "README.md is an entry page: move details to docs/"


def test_blocks_not_run_say_why():
    """A block the docs test does not run is fenced `console` or `py` and the sentence before it says so;
    fences without a language hold no commands (diagrams, file trees)."""
    for page in pages():
        for language, code, before in blocks(page):
            where = f"{page.relative_to(ROOT)}: block {code.splitlines()[0] if code else ''!r}"
            assert language in RUN | NOT_RUN | {"", "yaml", "json", "text"}, f"{where}: unknown fence {language!r}"
            if language in NOT_RUN:
                assert "not run" in " ".join(before.lower().split()), f"{where}: say before it why it is not run"
            if language in {"", "text"}:
                commands = [line for line in code.splitlines() if line.lstrip().startswith(COMMAND_STARTS)]
                assert not commands, f"{where}: {commands[0]!r} is a command: fence it bash (or console, saying why)"


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(1.0 / np.mean((a - b) ** 2)))


def _picture(path) -> np.ndarray:
    from PIL import Image
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.float64) / 255.0


def test_doc_command_blocks_run_verbatim(tmp_path, monkeypatch):
    """Every `bash` and `python` block of the README and docs/ runs, in reading order; the README's pictures
    show what it says they show (the known edit and the learned inversion, each closer to its own target
    than to the unedited picture, with the shapes kept)."""
    from PIL import Image

    from qwen_edit_core.data import synthetic
    from qwen_edit_core.demo import edge_similarity

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("WORK", raising=False)
    ran = []
    for page in pages():
        for language, code, _ in blocks(page):
            if language == "bash":
                for args in shell_commands(code):
                    run_shell_line(args, monkeypatch)
                    ran.append(args[1] if args[0] == PREFIX else args[0])
            elif language == "python":
                exec(compile(code, f"{page.name} block", "exec"), {"__name__": "__doc_block__"})
                ran.append("python")
    assert {"tiny", "sample", "pairs", "cache", "train", "python"} <= set(ran)
    work = Path(os.environ["WORK"])
    assert work.is_relative_to(tmp_path)
    control = Image.open(ROOT / "examples" / "in.png").convert("RGB")
    edits = {**synthetic.EDITS, synthetic.DEMO_EDIT[0]: synthetic.DEMO_EDIT[1]}
    for out, edit in (("known.png", readme_prompt("known.png")), ("inverted.png", synthetic.DEMO_EDIT[0])):
        target = np.asarray(edits[edit](control), dtype=np.float64) / 255.0
        picture = _picture(work / out)
        assert _psnr(picture, target) > _psnr(picture, np.asarray(control) / 255.0), f"{out} does not show {edit!r}"
        # and keeps the shapes (the demo's measure and threshold: tests/app/test_demo.py)
        assert edge_similarity(picture, target) >= KEEPS_THE_SHAPES, f"{out}: the shapes are lost"


@pytest.mark.parametrize("command, shown", [("demo", "(default: 250)"),
                                            ("pairs", "(default: 128)"), ("tiny", "(default: edit)")])
def test_help_shows_defaults(capsys, command, shown):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    assert shown in " ".join(capsys.readouterr().out.split())


def test_the_readme_run_is_the_demo_run(tmp_path, monkeypatch):
    """examples/tiny_train.yaml (the README's training) trains as `qwen-edit demo` does, so the README's picture
    after training is the demo's: same LoRA, batch, steps, optimizer, schedule and number of pairs."""
    from qwen_edit_core import demo
    from qwen_edit_core.config import load_config

    monkeypatch.setenv("WORK", str(tmp_path))
    readme = load_config(ROOT / "examples" / "tiny_train.yaml")
    ours = demo._config(tmp_path / "toy", tmp_path / "pairs", tmp_path / "demo", readme.train.max_steps)
    for section, keys in (("model", ("lora",)), ("data", ("batch_size", "vae_area")),
                          ("train", ("max_steps", "seed")), ("optimizer", ("type", "lr", "weight_decay")),
                          ("lr_scheduler", ("type", "warmup_steps"))):
        for key in keys:
            assert getattr(getattr(readme, section), key) == getattr(getattr(ours, section), key), f"{section}.{key}"
    assert readme.train.max_steps == inspect.signature(demo.run_demo).parameters["steps"].default
    pairs = [args for language, code, _ in blocks(ROOT / "README.md") if language == "bash"
             for args in shell_commands(code) if args[:2] == [PREFIX, "pairs"]]
    assert pairs and pairs[0][pairs[0].index("--count") + 1] == str(demo.N_TRAIN)


def test_every_guarantee_names_tests_that_exist():
    """docs/GUARANTEES.md lists nothing that a test does not check: every section, and every bullet of a
    section, names at least one test function, and every test function and file it names exists."""
    text = (ROOT / "docs" / "GUARANTEES.md").read_text()
    tests = ROOT / "tests"
    defined = {m for path in tests.rglob("test_*.py") for m in re.findall(r"^def (test_\w+)", path.read_text(),
                                                                              flags=re.M)}
    files = set(re.findall(r"\b(tests/[\w/]+\.py)", text))
    assert files and all((ROOT / f).is_file() for f in files), sorted(f for f in files if not (ROOT / f).is_file())
    named = set(re.findall(r"\b(test_\w+)\b(?!\.py)", text))
    assert named and not named - defined, sorted(named - defined)
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert len(sections) >= 10
    for section in sections:
        bullets = re.split(r"^- ", section, flags=re.M)
        parts = bullets[1:] if len(bullets) > 1 else bullets
        for part in parts:
            assert re.search(r"\btest_\w+\b(?!\.py)", part), f"names no test: {part[:200]!r}"
