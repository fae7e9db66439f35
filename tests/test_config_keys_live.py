"""Every config key is read somewhere outside ``config/``: a key that nothing reads gives a
user who sets it no effect and no error (issue 12: grpo.overlong_* and sync.verify were)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from megatron_grpo.config.schema import Config

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_grpo"


def _keys(cls, prefix: str = "") -> list[tuple[str, str]]:
    """``(dotted key, field name)`` for every leaf field of the config tree."""
    out = []
    hints = {f.name: f for f in dataclasses.fields(cls)}
    for name, f in hints.items():
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            out += _keys(type(default), f"{prefix}{name}.")
        else:
            out.append((f"{prefix}{name}", name))
    return out


def _attributes_read() -> set[str]:
    """Names of every attribute access (``x.name``) in the package's code outside config/;
    strings, comments and docstrings do not count (the AST has no attribute nodes there)."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] == "config":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    return names


def test_every_config_key_is_read_outside_config():
    read = _attributes_read()
    keys = _keys(Config)
    assert len(keys) > 60  # the walk reached every section
    dead = [key for key, name in keys if name not in read]
    assert not dead, f"config keys read nowhere outside megatron_grpo/config/: {dead}"
