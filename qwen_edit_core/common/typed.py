"""Typed nested dicts -> frozen dataclasses: every value checked against its field's type hint (Literal, Union,
tuple, bool, int, float, str, nested dataclasses), unknown keys refused, each error naming the dotted key path.
The config (qwen_edit_core/config.py) reads YAML through `from_dict` and re-exports `ConfigError`.

Every bad key and value is reported at once: `from_dict` given a `problems` list appends each problem there and
leaves that field at its default, so the caller can go on to check ranges and report everything together.
Values are shown through a bounded repr (`show`): a value built from nested YAML aliases can expand to billions
of items, and printing it whole would hang the error message itself.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import reprlib
import types
import typing
from typing import Any


class ConfigError(ValueError):
    """A config key or value that is not accepted; the message names its dotted path."""


_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxlist, _SHOW.maxtuple, _SHOW.maxdict = 3, 6, 6, 6
_SHOW.maxstring, _SHOW.maxother, _SHOW.maxlong = 80, 80, 40
#: bad items of one list reported before the rest are counted only
MAX_ITEM_PROBLEMS = 5


def show(value: Any) -> str:
    """A repr of `value` bounded in depth and length (nested lists of aliases stay a few dozen characters)."""
    return _SHOW.repr(value)


def _kind(hint: Any) -> str:
    """What a type hint accepts, in words (for error messages)."""
    origin = typing.get_origin(hint)
    if hint is type(None):
        return "null"
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, typing.get_args(hint)))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_kind(option) for option in typing.get_args(hint))
    if hint is tuple or origin is tuple:
        args = typing.get_args(hint)
        if len(args) != 2 or args[1] is not Ellipsis:
            return "a list"
        item = "mapping" if dataclasses.is_dataclass(args[0]) else _kind(args[0]).split(" ", 1)[-1]
        return f"a list of {item}s"
    if dataclasses.is_dataclass(hint):
        return "a mapping (section)"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


def _union(value: Any, hint: Any, path: str) -> Any:
    """The first option of a Union that accepts `value`; else the most specific error: the only option's own
    (`X | None`), or one inside the value (a bad list item), over 'not accepted'."""
    options = typing.get_args(hint)
    if value is None and type(None) in options:
        return None
    deeper, errors = None, []
    for option in options:
        if option is type(None):
            continue
        try:
            return _coerce(value, option, path)
        except ConfigError as err:
            errors.append(err)
            if str(err).startswith((f"{path}[", f"{path}.")):
                deeper = deeper or err
    if len(errors) == 1:  # `X | None`: X's own message ("expected a finite number, got nan")
        raise errors[0]
    raise deeper or ConfigError(f"{path}: {show(value)} is not accepted; expected {_kind(hint)}")


def _items(value: Any, hint: Any, path: str, problems: list[str] | None) -> tuple:
    """A list checked item by item against `tuple[X, ...]` (`hint`'s X); with `problems`, bad items are listed
    there (the first MAX_ITEM_PROBLEMS, then a count) and left out."""
    item_hint, items, bad = typing.get_args(hint)[0], [], 0
    for i, item in enumerate(value):
        try:
            items.append(_coerce(item, item_hint, f"{path}[{i}]", problems))
        except ConfigError as err:
            if problems is None:
                raise
            bad += 1
            if bad <= MAX_ITEM_PROBLEMS:
                problems.append(str(err))
    if bad > MAX_ITEM_PROBLEMS:
        problems.append(f"{path}: {bad - MAX_ITEM_PROBLEMS} more bad item(s)")
    return tuple(items)


def _coerce(value: Any, hint: Any, path: str, problems: list[str] | None = None) -> Any:
    """Check `value` against a field's type hint, converting only lossless cases (int -> float, list -> tuple).
    `problems`: where nested sections and list items report their problems (see `from_dict`)."""
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping (section), got {show(value)}")
        return from_dict(hint, value, path, problems)
    origin = typing.get_origin(hint)
    if hint is Any:
        return tuple(value) if isinstance(value, list) else value
    if origin is typing.Literal:
        options = typing.get_args(hint)
        if value not in options:
            raise ConfigError(f"{path}: {show(value)} is not accepted; accepted: {', '.join(map(str, options))}")
        return value
    if origin in (typing.Union, types.UnionType):
        return _union(value, hint, path)
    if hint is tuple or origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected {_kind(hint)}, got {show(value)}")
        args = typing.get_args(hint)
        return _items(value, hint, path, problems) if len(args) == 2 and args[1] is Ellipsis else tuple(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {show(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {show(value)}")
        if not math.isfinite(value):
            raise ConfigError(f"{path}: expected a finite number, got {show(value)}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {show(value)}")
        return value
    if hint is str:
        if value is None:
            return ""
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{path}: expected a string, got {show(value)}")
        return str(value)
    return value


def from_dict(cls: type, data: dict, path: str = "", problems: list[str] | None = None) -> Any:
    """Build the dataclass `cls` from nested dicts, rejecting unknown keys and bad values by their dotted path.

    Without `problems`, raises one ConfigError listing every problem; with a list, appends them there and
    returns the dataclass with each bad field at its default (so range checks can run on the rest)."""
    found: list[str] = [] if problems is None else problems
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in names:
            found.append(f"unknown config key {show(where)}; accepted here: {', '.join(sorted(names))}")
            continue
        try:
            values[key] = _coerce(value, hints[key], where, found)
        except ConfigError as err:
            found.append(str(err))
    if problems is None and found:
        raise ConfigError("; ".join(found))
    return cls(**values)


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_env(value: Any, path: str = "", source: str = "") -> Any:
    """A config file's `${NAME}` references replaced by the environment variable NAME, in every string value
    (so one file serves any working folder: `output_dir: ${WORK}/run`); an unset NAME is a ConfigError naming
    `source` (the file) and the key. Only the braced form is read, so a `$` elsewhere in a path stays."""
    if isinstance(value, dict):
        return {key: expand_env(item, f"{path}.{key}" if path else str(key), source) for key, item in value.items()}
    if isinstance(value, list):
        return [expand_env(item, f"{path}[{i}]", source) for i, item in enumerate(value)]
    if not isinstance(value, str):
        return value
    missing = [name for name in _ENV_REF.findall(value) if name not in os.environ]
    if missing:
        raise ConfigError(f"{source}{path}: {value!r} names the environment variable ${{{missing[0]}}}, which is "
                          f"not set; set it (export {missing[0]}=...) or write the value out")
    return _ENV_REF.sub(lambda m: os.environ[m.group(1)], value)
