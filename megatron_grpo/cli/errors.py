"""User errors end the command with one clear line and a non-zero exit, no traceback.

Under torchrun each rank makes the same checks; how the ranks of a refused launch print
one line and agree on their exit code is explained in docs/errors.md ("Under torchrun").
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from megatron_grpo.config import ConfigError

# A rank other than 0 that refuses waits this long for its launcher to stop it; rank 0
# refuses too and exits at once, and torchrun stops the other ranks within its monitor
# interval (0.1 s). A rank still waiting after it prints the line itself: rank 0 did not
# refuse (a file missing on this node only), and the message must not be lost.
PEER_WAIT_S = 60.0
# What a launcher sends to stop a rank: torchrun SIGTERM (its --signals-to-handle passes
# SIGINT / SIGHUP on), srun --kill-on-bad-exit SIGTERM.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_previous: dict = {}  # the stop handlers exit_2_when_stopped replaced


@contextlib.contextmanager
def exit_on_user_error(alike_on_every_rank: bool = False):
    """Turn configuration and input errors into ``error: <message>`` and exit code 2.

    The same config on every rank gives the same ConfigError: the console shows rank 0's.
    A missing file or an unsupported model is shown by every rank that meets it (it may
    be missing on one node only), unless ``alike_on_every_rank``: the checks inside reach
    the same verdict on every rank (``train``'s preflight), and rank 0 alone prints.
    A rank other than 0 with such an error does not exit first (its launcher would stop
    rank 0 before it printed): it waits to be stopped, and then exits 2 (the handlers of
    :func:`exit_2_when_stopped`)."""
    from megatron_grpo.models.spec import UnsupportedModelError

    try:
        yield
    except (ConfigError, UnsupportedModelError, FileNotFoundError) as e:
        if (alike_on_every_rank or isinstance(e, ConfigError)) and _rank() != 0:
            _report(e, to_console=False)
            _wait_to_be_stopped()
        _report(e, to_console=not _refused_before(e))
        sys.exit(2)
    except Exception as e:
        from megatron_grpo.rollout.interface import RolloutFailure  # imports torch: only here

        if not isinstance(e, RolloutFailure):
            raise
        _report(e, to_console=True)
        sys.exit(1)


def exit_2_when_stopped() -> None:
    """In a rank of a multi-rank job (WORLD_SIZE > 1), from now until :func:`stop_as_usual`,
    a stop signal ends the rank with exit 2, the code of a refusal, instead of -15: when
    rank 0 refuses, torchrun stops the others, wherever their checks are. ``megatron-grpo``
    calls it first thing; elsewhere (one process) it does nothing."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or _previous:
        return
    if threading.current_thread() is not threading.main_thread():
        return
    _previous.update({sig: signal.signal(sig, _stopped) for sig in STOP_SIGNALS})


def stop_as_usual() -> None:
    """Put back the stop handlers :func:`exit_2_when_stopped` replaced: the checks passed
    (the trainer installs its own, trainer/checkpointer.py)."""
    for sig, handler in _previous.items():
        if handler is not None:  # None: set outside Python, cannot be put back
            signal.signal(sig, handler)
    _previous.clear()


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


def _refused_before(e: BaseException) -> bool:
    """Under torchrun with restarts (``--max-restarts``, as the launchers pass it), whether
    an earlier attempt of this job printed this same refusal: torchrun restarts after any
    failure, so a refusal would otherwise print its line once per attempt. The first
    attempt leaves a marker (per torchrun job: ``TORCHELASTIC_RUN_ID``) and the later ones,
    refusing the same way, exit 2 without the line; another refusal still prints."""
    env = os.environ
    if int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) < 1 or "TORCHELASTIC_RUN_ID" not in env:
        return False
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in env["TORCHELASTIC_RUN_ID"])
    marker = Path(tempfile.gettempdir()) / f"megatron-grpo-refused-{safe}-rank{_rank()}"
    line = f"error: {e}"
    try:
        if marker.read_text() == line:
            return True
    except OSError:
        pass
    with contextlib.suppress(OSError):
        marker.write_text(line)
    return False


def _stopped(signum, frame) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    # The refusal's code. No teardown: in the checks nothing has started; after them (a
    # refusal while building) vLLM and gloo threads may hold the interpreter at exit.
    os._exit(2)


def _wait_to_be_stopped() -> None:
    """A rank other than 0 refused: wait for the launcher to stop it (exit 2, silently),
    which it does once rank 0, refusing too, has printed the line and exited; past
    ``PEER_WAIT_S`` return, and the caller prints the line from this rank."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stopped)
    time.sleep(PEER_WAIT_S)


def _report(e: BaseException, to_console: bool) -> None:
    """``error: <message>`` on the console, and in train.log when output is captured."""
    # Output is captured only by metrics.console (capture()); a refusal before anything
    # loaded it must not load it now: it imports torch, seconds of a refused launch.
    console = sys.modules.get("megatron_grpo.metrics.console")
    if console is not None and console.log_path() is not None:
        print(f"error: {e}", file=sys.stderr, flush=True)
    if to_console:
        err = console.console_err() if console is not None else sys.stderr
        print(f"error: {e}", file=err, flush=True)
