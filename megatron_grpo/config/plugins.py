"""A user's object named in the config, ``package.module:name`` or ``path/to/file.py:name``:
a reward function (``reward.name``), a loss class (``grpo.loss.policy_loss``). One loader, with
errors that name the config key's kind of object and the fix."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any


def _load_file(file: str, path: str, what: str) -> ModuleType:
    """The module of a Python file given as ``path/to/file.py`` (relative to the working
    directory); loaded under a private name, again in each process that loads it."""
    source = Path(file).resolve()
    if not source.is_file():
        raise ValueError(
            f"{what} file {file!r} of {what} {path!r} does not exist (looked at {source}): "
            "give the path of a .py file, relative to the working directory or absolute."
        )
    name = f"_mgrpo_{what}_{abs(hash(str(source)))}"
    spec = importlib.util.spec_from_file_location(name, source)
    assert spec is not None and spec.loader is not None  # a .py file always has both
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(
            f"{what} file {source} failed to load ({type(e).__name__}: {e}): fix the file."
        ) from e
    return module


def load_object(path: str, what: str, kind: str, example: str) -> Any:
    """Import ``"package.module:name"`` or ``"path/to/file.py:name"`` and return the object;
    ``what`` (``reward``), ``kind`` (``function``) and ``example`` (``reward.name=mypkg.rewards:score``)
    word the one-line errors."""
    mod_name, sep, attr = path.rpartition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(
            f"{what} {kind} {path!r} is not 'package.module:{kind}' or "
            f"'path/to/file.py:{kind}': write it as e.g. {example}."
        )
    try:
        if mod_name.endswith(".py"):
            module = _load_file(mod_name, path, what)
        else:
            module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(
            f"cannot import module {mod_name!r} of {what} {path!r} ({e}): put it on PYTHONPATH "
            "or install its package."
        ) from e
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"module {mod_name!r} has no attribute {attr!r} ({what} {path!r}).")
    return obj
