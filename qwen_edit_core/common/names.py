"""The one rule for names that become file names (a LoRA's name, a job's name, a dataset's pair prefix) and the
rule for labels drawn as text (validation preview labels), and renaming a file's keys onto a model's names
(`rename`).

A name is joined to a folder the user chose (`output_dir / f"{name}.safetensors"`); a name holding a folder
separator, `..`, a drive or an absolute path would write outside that folder, so such names are refused before
anything runs rather than sanitised (a silently changed name is a file the user cannot find).
"""

from __future__ import annotations

from typing import Callable, Iterable

#: characters never accepted in a file name: folder separators, the Windows drive/stream separator, NUL
_FORBIDDEN = "/\\:\0"
#: longest name accepted (most file systems allow 255 bytes; suffixes such as `_ema.safetensors` are added)
MAX_NAME_BYTES = 200
MAX_LABEL_CHARS = 200


def file_name_problem(name: str) -> str | None:
    """What makes `name` unfit as a plain file name in a chosen folder, or None: empty, a folder separator
    (/ \\ :), `..` or a leading '.' (hidden files are ignored when a dataset is read), control characters,
    surrounding spaces, or more than MAX_NAME_BYTES bytes."""
    if not isinstance(name, str) or not name:
        return "is empty; give a plain file name such as my_lora"
    if any(c in name for c in _FORBIDDEN):
        return "holds a folder separator (/ \\ :); give a plain file name, no folders"
    if name.startswith("."):
        return "starts with '.' (hidden, or a parent folder '..'); give a plain file name"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "holds control characters (newline, tab, ...); give a plain file name"
    if name != name.strip():
        return "starts or ends with spaces; give a plain file name"
    if len(name.encode("utf-8")) > MAX_NAME_BYTES:
        return f"is longer than {MAX_NAME_BYTES} bytes; give a shorter name"
    return None


def check_file_name(name: str, what: str) -> str:
    """`name` when it is a plain file name (`file_name_problem`), else ValueError naming `what`."""
    problem = file_name_problem(name)
    if problem:
        raise ValueError(f"{what} {name!r:.80} {problem}")
    return name


def label_problem(label: str) -> str | None:
    """What makes `label` unfit as one line of text under a picture, or None: control characters (newlines,
    NUL) or more than MAX_LABEL_CHARS characters."""
    if any(ord(c) < 32 or ord(c) == 127 for c in label):
        return "holds control characters (newline, tab, NUL, ...); give one line of text"
    if len(label) > MAX_LABEL_CHARS:
        return f"is longer than {MAX_LABEL_CHARS} characters; give a short label"
    return None


def rename(names: Iterable[str], new_name: Callable[[str], str | None]) -> tuple[dict[str, str], list[str]]:
    """Each of `names` -> `new_name(name)`: ({name: its new name} in the order given, [the names `new_name` has no
    new name for (None)]), so a caller refuses every unknown name at once."""
    renamed, unknown = {}, []
    for name in names:
        new = new_name(name)
        if new is None:
            unknown.append(name)
        else:
            renamed[name] = new
    return renamed, unknown
