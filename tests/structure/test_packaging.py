"""The pack installs the ComfyUI way: requirements.txt (ComfyUI-Manager, `comfy node install`) leaves ComfyUI's
torch alone and agrees with pyproject.toml; the Comfy Registry finds its [tool.comfy] metadata; the license is
Apache-2.0 like the Qwen-Image-Edit weights and the Hugging Face libraries the core uses."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NEVER_IN_REQUIREMENTS = {"torch", "torchvision", "torchaudio"}


def _requirements() -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    return {re.split(r"[<>=!~ ]", line, maxsplit=1)[0].lower(): line for line in lines if line}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_requirements_leave_comfyuis_torch_alone_and_match_pyproject():
    requirements = _requirements()
    assert not NEVER_IN_REQUIREMENTS & set(requirements), "requirements.txt must not (re)install torch"
    declared = {re.split(r"[<>=!~ ]", dep, maxsplit=1)[0].lower(): dep
                for dep in _pyproject()["project"]["dependencies"]}
    assert set(declared) - NEVER_IN_REQUIREMENTS == set(requirements)
    for name, line in requirements.items():
        assert line == declared[name], f"requirements.txt {line!r} differs from pyproject.toml {declared[name]!r}"
        if name in ("diffusers", "transformers", "peft", "accelerate"):
            assert "<" in line, f"{name}: give an upper bound (the next major release is untested)"


def test_registry_metadata_and_license():
    project = _pyproject()
    comfy = project["tool"]["comfy"]
    for key in ("PublisherId", "DisplayName", "Icon"):
        assert comfy.get(key), f"[tool.comfy] {key} is missing"
    assert re.fullmatch(r"[a-z0-9][a-z0-9-]*", comfy["PublisherId"])
    assert comfy["Icon"].startswith("https://") and project["project"]["urls"]["Repository"].startswith("https://")
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["project"]["version"])
    assert project["project"]["license"] == {"file": "LICENSE"}
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert (ROOT / "docs" / "icon.svg").is_file()


def test_readme_install_section_names_the_three_ways():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Install in ComfyUI"):]
    section = section[:section.index("\n## ", 1)]
    for needle in ("ComfyUI-Manager", "comfy node install comfyui-qwen-edit-lora",
                   "pip install -r requirements.txt", "git clone"):
        assert needle in section, f"README install section lacks {needle!r}"
    assert "pip install diffusers peft accelerate" not in readme


def test_ci_runs_the_readmes_test_command_and_the_slow_tests_stay_runnable():
    """CI runs the README's `make test` (the slow tests left out), then `make test-slow`; the simulations have
    their own target."""
    commands = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert commands[-2:] == ["make test", "make test-slow"], commands
    makefile = (ROOT / "Makefile").read_text()
    assert '-m "not slow and not simulation"' in makefile and "-m slow" in makefile and "-m simulation" in makefile


def test_a_pip_install_carries_every_file_the_core_reads():
    """`pip install` ships what the core reads besides its Python source (the toys' weights and manifests, which
    `qwen-edit demo` and `qwen-edit tiny --pretrained` load, the architecture tables, the device script): every
    such tracked file under qwen_edit_core/ matches [tool.setuptools.package-data], and each family's toy weights
    are found inside the package."""
    import subprocess

    from qwen_edit_core.families import FAMILIES
    from qwen_edit_core.toys import toy

    core = ROOT / "qwen_edit_core"
    tracked = subprocess.run(["git", "ls-files", "qwen_edit_core"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    data = {ROOT / p for p in tracked if not p.endswith(".py")}
    shipped = {p for pattern in _pyproject()["tool"]["setuptools"]["package-data"]["qwen_edit_core"]
               for p in core.glob(pattern)}
    assert data and not data - shipped, f"not in package-data: {sorted(str(p) for p in data - shipped)}"
    for family in (f for f in FAMILIES.values() if f.toy is not None):
        weights = toy.weights_of(family)
        assert core in weights.parents and (weights / "transformer.safetensors") in shipped, family.name
