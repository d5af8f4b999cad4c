"""Typed nested dicts -> frozen dataclasses: every value checked against its field's type hint (Literal, Union,
tuple, bool, int, float, str, nested dataclasses), unknown keys refused, each error naming the dotted key path.
The config (qwen_edit_core/config.py) reads YAML through `from_dict` and re-exports `ConfigError`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from typing import Any


class ConfigError(ValueError):
    """A config key or value that is not accepted; the message names its dotted path."""


def _coerce(value: Any, hint: Any, path: str) -> Any:
    """Check `value` against a field's type hint, converting only lossless cases (int -> float, list -> tuple)."""
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping (section), got {type(value).__name__}")
        return from_dict(hint, value, path)
    origin = typing.get_origin(hint)
    if hint is Any:
        return tuple(value) if isinstance(value, list) else value
    if origin is typing.Literal:
        options = typing.get_args(hint)
        if value not in options:
            raise ConfigError(f"{path}: {value!r} is not accepted; accepted: {', '.join(map(str, options))}")
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, path)
            except ConfigError as err:
                errors.append(err)
        if len(errors) == 1:  # `X | None`: X's own message ("expected a finite number, got nan")
            raise errors[0]
        names = ", ".join("null" if o is type(None) else getattr(o, "__name__", str(o)) for o in options)
        raise ConfigError(f"{path}: {value!r} is not one of: {names}")
    if hint is tuple or origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(item, args[0], f"{path}[{i}]") for i, item in enumerate(value))
        return tuple(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{path}: expected a finite number, got {value!r}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if hint is str:
        if value is None:
            return ""
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return str(value)
    return value


def from_dict(cls: type, data: dict, path: str = "") -> Any:
    """Build the dataclass `cls` from nested dicts, rejecting unknown keys by their dotted path."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            where = f"{path}.{key}" if path else str(key)
            raise ConfigError(f"unknown config key {where!r}; accepted here: {', '.join(sorted(names))}")
    values = {key: _coerce(value, hints[key], f"{path}.{key}" if path else key) for key, value in data.items()}
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
