"""A pair's caption: reading its file, the one rule for caption text (shared by the dataset reader and the pair
writer), and its length in tokens, counted by the tokenizer alone while the dataset is validated.

The text encoder takes a prompt of at most `MAX_SEQUENCE_LENGTH` (1,024) tokens of its own text (the control
images' vision tokens come on top and are not counted), so a longer caption can never be encoded. Counting
needs only the tokenizer (milliseconds to load), so an over-long caption is reported by file before any model
loads, with every other problem of the dataset. A caption over MAX_CAPTION_BYTES is refused without being tokenized (a
1 MB caption would take seconds to tokenize and is over the limit whatever its tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from qwen_edit_core.data.examples import Problem
from qwen_edit_core.families.templates import MAX_SEQUENCE_LENGTH

CAPTION_EXTENSION = ".txt"
CAPTIONS_DIR = "captions"
#: captions longer than this are refused unread by the tokenizer: 64 bytes per token, far above any text's
MAX_CAPTION_BYTES = 64 * MAX_SEQUENCE_LENGTH
#: the control characters a caption may hold (line breaks and tabs); any other (NUL, escape, ...) is refused
ALLOWED_CONTROLS = "\n\r\t"


#: the problem of a caption file holding no text
EMPTY_CAPTION = "caption is empty; write the edit instruction (UTF-8 text)"


def caption_text_problem(text: str) -> str | None:
    """What makes `text` unfit as a caption, or None: empty, more than MAX_CAPTION_BYTES, or a control character
    other than a line break or a tab (a NUL byte, an escape sequence: never part of an instruction)."""
    if not text.strip():
        return EMPTY_CAPTION
    size = len(text.encode("utf-8"))
    if size > MAX_CAPTION_BYTES:
        return (f"caption is {size} bytes, more than the text encoder's {MAX_SEQUENCE_LENGTH} tokens can hold "
                f"(captions over {MAX_CAPTION_BYTES} bytes are refused); shorten it")
    bad = next((i for i, c in enumerate(text) if (ord(c) < 32 and c not in ALLOWED_CONTROLS) or ord(c) == 127),
               None)
    if bad is not None:
        return (f"caption holds the control character U+{ord(text[bad]):04X} at character {bad}; save it as plain "
                "text (line breaks and tabs are fine)")
    return None


def read_caption(captions: tuple[Path, ...], default: Path) -> tuple[str | None, Problem | None]:
    """The stripped text of the first of `captions` (the one used), or the problem with it; `default` is where
    a missing caption is expected."""
    if not captions:
        return None, Problem(default, "caption file is missing; write the edit instruction as UTF-8 text to "
                                      f"{default.name} beside the image (or {CAPTIONS_DIR}/{default.name})")
    path = captions[0]
    try:
        with path.open("rb") as fh:
            data = fh.read(MAX_CAPTION_BYTES + 4)  # never more: a caption over the bound is refused unread
    except OSError as err:
        return None, Problem(path, f"caption cannot be read ({err})")
    if len(data) > MAX_CAPTION_BYTES:
        return None, Problem(path, f"caption is {path.stat().st_size} bytes, more than the text encoder's "
                                   f"{MAX_SEQUENCE_LENGTH} tokens can hold (captions over {MAX_CAPTION_BYTES} "
                                   "bytes are refused); shorten it")
    try:
        # A BOM (U+FEFF) is invisible: tolerated at the start and anywhere else (e.g. concatenated files).
        text = data.decode("utf-8-sig").replace("\ufeff", "").strip()
    except UnicodeDecodeError as err:
        return None, Problem(path, f"caption is not UTF-8 text (invalid byte at offset {err.start}); save it as "
                                   "UTF-8")
    problem = caption_text_problem(text)
    return (None, Problem(path, problem)) if problem else (text, None)


def caption_length_problem(path: Path, text: str, count_tokens: Callable[[str], int] | None,
                           limit: int = MAX_SEQUENCE_LENGTH) -> Problem | None:
    """A problem naming `path` when the caption alone has more than `limit` tokens (`count_tokens`: the text
    encoder's tokenizer; None: not checked)."""
    if count_tokens is None:
        return None
    tokens = count_tokens(text)
    if tokens <= limit:
        return None
    return Problem(path, f"caption is {tokens} tokens; the text encoder takes at most {limit}: shorten it")
