"""What the subcommand modules share: registering a command, and filling its arguments
dataclass from the parsed options."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


def add_command(
    sub: argparse._SubParsersAction, name: str, run: Callable[[argparse.Namespace], int]
) -> argparse.ArgumentParser:
    """Register the command ``name``, running ``run(args)``; ``run``'s docstring is its
    text: the first paragraph in the list of commands, the rest in its own ``--help``."""
    summary, _, description = (inspect.getdoc(run) or "").partition("\n\n")
    p = sub.add_parser(name, help=" ".join(summary.split()), description=description)
    p.set_defaults(func=run)
    return p


def from_args(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """``cls`` (a dataclass) with every field that has an option of the same name taken
    from ``args``, then ``given``; the other fields keep their defaults."""
    names = [f.name for f in dataclasses.fields(cls) if hasattr(args, f.name)]
    return cls(**{**{n: getattr(args, n) for n in names}, **given})
