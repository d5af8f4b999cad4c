"""Stages never name a model family: outside `qwen_edit_core/families/` (and the tests), no module holds a
variant or family name, a family's class names or cache tensor keys as a string, a family's description by its
constant (`QWEN_IMAGE_21`), an import of a family's subpackage, or an `is_<family>` test. Stages ask the family
(`families.family_of`, `Family` fields, `Family.stage`) instead, so a new family is one new subpackage.

Text is held to the same rule: a docstring, comment, message or help text may name a family by its title, for
people ("Qwen-Image-2.1", "Edit Plus"), never by a machine string (a variant, encoding or family name such as
"edit-plus", a class name such as the 2.1 transformer's): those belong to `families/` and reach other text
through a Family field. A variant name that is an English word ("edit") counts only as a whole string. A string
that only looks like a variant's name (the demo's metric "edit") carries the comment `NOT_A_FAMILY` on its line. `ALLOWED` lists modules that still name one, each with why; it only shrinks (it is empty).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from qwen_edit_core import families
from qwen_edit_core.families import variants

ROOT = Path(__file__).resolve().parents[2]
FAMILIES_DIR = ROOT / "qwen_edit_core" / "families"

#: module path -> why it still names a family (remove the entry when the module stops)
ALLOWED: dict[str, str] = {}


def family_strings() -> set[str]:
    """Every string that names a family or one of its variants, classes or cache tensors."""
    names = set(variants.NAMES) | {v.encoding for v in variants.VARIANTS.values()} | set(families.REFERENCE_LAYOUTS)
    for family in families.FAMILIES.values():
        names |= {family.name, family.transformer_class, family.vae_class, family.text_encoder_class,
                  family.processor_class, family.block_class, *family.cache_tensors}
        names.add(family.cache_name)
    return {n for n in names if n}


def family_identifiers() -> set[str]:
    """Names of the family descriptions' constants and of the family classes (as Python identifiers)."""
    constants = {name for name, value in vars(families).items() if isinstance(value, families.Family)} - {"DEFAULT"}
    classes = {cls for f in families.FAMILIES.values()
               for cls in (f.transformer_class, f.vae_class, f.text_encoder_class, f.processor_class, f.block_class)}
    return constants | classes


def machine_names() -> set[str]:
    """The family strings text may not hold anywhere inside it: variant, encoding and family names and the family
    classes, except plain lowercase words ("edit"), which only count as a whole string."""
    names = set(variants.NAMES) | {v.encoding for v in variants.VARIANTS.values()}
    for family in families.FAMILIES.values():
        names |= {family.name, family.cache_name, family.transformer_class, family.vae_class,
                  family.text_encoder_class, family.processor_class, family.block_class}
    return {n for n in names if n and not (n.isalpha() and n.islower())}


def _in_text(names: set[str]) -> re.Pattern:
    """Any of `names` as a word of its own in text (not part of a longer name, a path or a title: "image-2.1" is
    found in "use image-2.1" and "qwen-image-2.1", not in "Qwen-Image-2.1")."""
    alternatives = "|".join(map(re.escape, sorted(names, key=len, reverse=True)))
    return re.compile(rf"(?<![\w.])({alternatives})(?![\w-]|\.\d)")


FAMILY_TEST = re.compile(r"(^|_)is_\d+")
#: the comment that marks a string on its line as not a family's or variant's name
NOT_A_FAMILY = "# not a family name"


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of `tree` (module, class and function docstrings)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                     str):
                found.add(id(first.value))
    return found


def _texts(source: str, tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of every string (docstrings, messages, f-string parts) and comment of a module."""
    found = [(node.lineno, node.value) for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    return found + [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
                    if token.type == tokenize.COMMENT]


def names_of_families(path: Path) -> list[tuple[int, str]]:
    """(line, what) for each place `path` names a family."""
    source = path.read_text()
    tree = ast.parse(source, filename=str(path))
    strings, identifiers, docs = family_strings(), family_identifiers(), _docstrings(tree)
    marked = {n for n, line in enumerate(source.splitlines(), start=1) if line.rstrip().endswith(NOT_A_FAMILY)}
    in_text = _in_text(machine_names())
    found = [(line, match.group(1)) for line, text in _texts(source, tree) if line not in marked
             for match in in_text.finditer(text)]
    subpackages = {p.name for p in FAMILIES_DIR.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if node.value in strings and node.lineno not in marked:
                found.append((node.lineno, node.value))
        elif isinstance(node, ast.Name) and (node.id in identifiers or FAMILY_TEST.search(node.id)):
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute) and (node.attr in identifiers or FAMILY_TEST.search(node.attr)):
            found.append((node.lineno, node.attr))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and FAMILY_TEST.search(node.name):
            found.append((node.lineno, node.name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            for module in modules:
                parts = module.split(".")
                if parts[:2] == ["qwen_edit_core", "families"] and len(parts) > 2 and parts[2] in subpackages:
                    found.append((node.lineno, module))
            for alias in node.names:
                if alias.name in identifiers:
                    found.append((node.lineno, alias.name))
    return sorted(set(found))


def _stage_modules() -> list[Path]:
    core = [p for p in (ROOT / "qwen_edit_core").rglob("*.py") if FAMILIES_DIR not in p.parents]
    return sorted(core + list((ROOT / "nodes").rglob("*.py")))


def test_the_check_sees_each_way_of_naming_a_family(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('"""Qwen-Image-2.1 and the edit variant in a docstring are fine, its edit-plus variant is not."""\n'
                     '# a comment on QwenImage21TransformerBlock\n'
                     'from qwen_edit_core.families import QWEN_IMAGE_21\n'
                     'from qwen_edit_core.families.qwen_image_21 import sampler\n'
                     'variant = "image-2.1"\n'
                     'message = f"a Qwen-Image-2.1 model: use --variant qwen-image-2.1, not {variant}"\n'
                     'metric = {"edit": 1}  ' + NOT_A_FAMILY + '\n'
                     'def is_21(x):\n    return "prompt_slots" in x or x.__name__ == "QwenImage21Transformer2DModel"\n')
    found = {what for _, what in names_of_families(probe)}
    assert found == {"QWEN_IMAGE_21", "qwen_edit_core.families.qwen_image_21", "image-2.1", "is_21", "prompt_slots",
                     "qwen_edit_core.families.qwen_image_21.sampler", "QwenImage21Transformer2DModel", "edit-plus",
                     "QwenImage21TransformerBlock", "qwen-image-2.1"}, found


@pytest.mark.parametrize("path", _stage_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_stages_never_name_a_family(path: Path):
    rel = str(path.relative_to(ROOT))
    bad = [f"line {line}: {what}" for line, what in names_of_families(path) if rel not in ALLOWED]
    assert not bad, (f"{rel} names a model family (ask the family instead: families.family_of, a Family field, "
                     "Family.stage; see docs/DESIGN.md, 'Adding a model family'):\n" + "\n".join(bad))


def test_stages_ask_which_family_through_one_function():
    """Outside `families/`, `families.family_of` alone answers which family a model, directory, config, file header,
    file metadata, cache key or entry, or batch is; the helpers it dispatches to are the families' own."""
    helper = re.compile(r"\bfamily_of_\w+")
    bad = [f"{path.relative_to(ROOT)}:{n}: {match.group(0)}" for path in _stage_modules()
           for n, line in enumerate(path.read_text().splitlines(), start=1) if (match := helper.search(line))]
    assert not bad, "ask `families.family_of` instead:\n" + "\n".join(bad)


def test_the_allowlist_holds_only_what_is_still_there():
    stale = [rel for rel in ALLOWED if not (ROOT / rel).is_file() or not names_of_families(ROOT / rel)]
    assert not stale, f"remove these from ALLOWED (they no longer name a family): {stale}"
