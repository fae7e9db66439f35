"""What the subcommand modules share: registering a command, filling its arguments
dataclass from the parsed options, and a quiet console (``quiet_console``)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

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


def quiet_console(log: Path, verbose: bool) -> Callable[[], TextIO]:
    """Unless ``verbose``: library output (warnings, vLLM INFO, the spawned ranks') to
    ``log``, the command's own lines to the console (metrics/console.py ``capture``, as
    ``train``). Returns where the command's own lines go.

    A caller of ``main()`` in its own process that has already redirected ``sys.stdout``
    (``contextlib.redirect_stdout``, pytest's capture) keeps its redirection: the process's
    descriptors are not this command's to take."""
    if verbose or sys.stdout is not sys.__stdout__:
        return lambda: sys.stdout
    from megatron_grpo.metrics.console import capture, console_out, say

    capture(log, int(os.environ.get("RANK", "0")))
    if os.environ.get("RANK", "0") == "0":
        say(f"library output goes to {log} (--verbose shows it)")
    return console_out
