"""Load the config tree from YAML plus dotted ``key=value`` overrides, and write it back.

Values are coerced to the field's declared type, so ``grpo.group_size=16`` is an int and
``parallel.vpp=null`` is None. An unknown key raises, naming the close keys of its section
(``did you mean``, difflib), or all of them when none is close. Old keys of
the last release move to their new place first, with a one-line notice (``config/deprecated.py``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from megatron_grpo.config.deprecated import move_deprecated
from megatron_grpo.config.schema import Config, ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

D = TypeVar("D", bound="DataclassInstance")


def _field_types(cls: type) -> dict[str, object]:
    return typing.get_type_hints(cls)


def _coerce(key: str, value: Any, tp: object) -> object:
    """Convert ``value`` (from YAML or a command-line string) to the annotated type ``tp``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}={value!r}: cannot be null.")
    if origin is typing.Literal:
        # Literal choices are validated by the section's __post_init__, with its message.
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}={value!r} is not a boolean: use true or false.")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} is not an integer.")
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r} is not an integer.") from None
        if as_float != int(as_float):
            raise ConfigError(f"{key}={value!r} is not an integer.")
        return int(as_float)
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} is not a number.")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r} is not a number.") from None
    if tp is str:
        if value is None:
            raise ConfigError(f"{key} cannot be null.")
        return str(value)
    return value


def _build(cls: type[D], data: dict, prefix: str) -> D:
    """Build dataclass ``cls`` from a nested dict, checking every key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {type(data).__name__}.")
    hints = _field_types(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, object] = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(_unknown_key(full, key, names, prefix))
        tp = hints[key]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value or {}, f"{full}.")
        else:
            kwargs[key] = _coerce(full, value, tp)
    return cls(**kwargs)


def _unknown_key(full: str, key: str, names: list[str], prefix: str) -> str:
    """One line for an unknown key: the section's close names (difflib) when there are any,
    else every name of the section."""
    where = prefix.rstrip(".") or "the top level"
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
    if close:
        shown = " or ".join(repr(f"{prefix}{c}") for c in close)
        return f"unknown config key {full!r}: did you mean {shown}?"
    return f"unknown config key {full!r}: {where} has {names}."


def parse_overrides(overrides: list[str]) -> dict:
    """Turn ``["a.b=1", "c=x"]`` into ``{"a": {"b": "1"}, "c": "x"}`` (values typed later)."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (example: grpo.group_size=16).")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section.")
        # YAML parsing gives lists, null and numbers their usual meaning on the command line.
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node[parts[-1]] = value
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _yaml_error(path: Path, e: yaml.YAMLError) -> str:
    """PyYAML's multi-line report as one line: ``file:line:col: problem``."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    context = getattr(e, "context", None)
    what = f"{context}, {problem}" if context else problem
    return f"config file {where} is not valid YAML ({what}): fix it at that line and column."


def load_config(
    path: str | os.PathLike | None = None, overrides: list[str] | None = None
) -> Config:
    """Load ``path`` (YAML; None = the defaults), apply ``overrides``, validate, return it."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(
                f"config file {str(p)!r} does not exist: pass a YAML file (see configs/)."
            )
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(_yaml_error(p, e)) from None
    if overrides:
        data = _merge(data, parse_overrides(overrides))
    return _build(Config, move_deprecated(data), "")


def save_config(cfg: Config, run_dir: str | os.PathLike) -> Path:
    """Write the resolved config to ``run_dir/config.yaml`` (and return the path)."""
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / "config.yaml"
    tmp = target.with_suffix(".yaml.tmp")
    tmp.write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    os.replace(tmp, target)
    return target


def format_config(cfg: Config) -> str:
    """The resolved config as indented JSON, for printing at start."""
    return json.dumps(dataclasses.asdict(cfg), indent=2)
