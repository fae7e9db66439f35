"""User errors end the command with one clear line and a non-zero exit, no traceback."""

from __future__ import annotations

import contextlib
import os
import sys

from megatron_grpo.config import ConfigError


@contextlib.contextmanager
def exit_on_user_error(alike_on_every_rank: bool = False):
    """Turn configuration and input errors into ``error: <message>`` and exit code 2.

    The same config on every rank gives the same ConfigError: the console shows rank 0's.
    A missing file or an unsupported model is shown by every rank that meets it (it may
    be missing on one node only), unless ``alike_on_every_rank``: the checks inside reach
    the same verdict on every rank (``train``'s preflight), and rank 0 alone prints."""
    from megatron_grpo.models.spec import UnsupportedModelError
    from megatron_grpo.rollout.interface import RolloutFailure

    try:
        yield
    except (ConfigError, UnsupportedModelError, FileNotFoundError) as e:
        alike = alike_on_every_rank or isinstance(e, ConfigError)
        _report(e, to_console=not alike or _rank() == 0)
        sys.exit(2)
    except RolloutFailure as e:
        _report(e, to_console=True)
        sys.exit(1)


@contextlib.contextmanager
def exit_on(errors: type[BaseException] | tuple[type[BaseException], ...], code: int):
    """End the command with ``error: <message>`` and exit ``code`` when ``errors`` is raised
    inside: a benchmark's bad arguments (ValueError, 2) or failed run (1)."""
    try:
        yield
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(code)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _report(e: BaseException, to_console: bool) -> None:
    """``error: <message>`` on the console, and in train.log when output is captured."""
    from megatron_grpo.metrics.console import console_err, log_path

    if log_path() is not None:
        print(f"error: {e}", file=sys.stderr, flush=True)
    if to_console:
        print(f"error: {e}", file=console_err(), flush=True)
