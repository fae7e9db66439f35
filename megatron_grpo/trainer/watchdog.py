"""A bound on every wait of the training loop that can otherwise hang for good.

A rollout blocked in a dead vLLM engine, a reward call, a weight sync whose peer died, a
checkpoint barrier another rank never reaches: none of these returns by itself (under NCCL
``Work.wait`` returns at once, so a collective's timeout bounds nothing). ``bounded(what,
seconds)`` runs a watchdog thread beside the wait; past the deadline it prints one line
naming the phase, the step and the setting that bounds it, and ends the process (exit 3):
a blocked C call cannot be interrupted from Python, and the launcher (torchrun, Slurm)
then stops the other ranks. Children die with the process (platform/lifetime.py).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from megatron_grpo.metrics.console import console_err, log_path
from megatron_grpo.trainer.restarts import note_failure

EXIT_TIMEOUT = 3


def exit_timeout(message: str) -> None:
    """Print ``message`` (console and train.log) and end the process with status 3."""
    if log_path() is not None:
        print(message, file=sys.stderr, flush=True)
    print(message, file=console_err(), flush=True)
    os._exit(EXIT_TIMEOUT)


@contextlib.contextmanager
def bounded(
    what: str, seconds: float, setting: str, on_timeout: Callable[[str], object] = exit_timeout
) -> Iterator[None]:
    """Run the body; if it has not finished after ``seconds``, call ``on_timeout`` with
    ``error: <what> did not finish within <seconds>s (<setting>): ...`` (default: print it
    and exit the process with status 3)."""
    done = threading.Event()
    rank = os.environ.get("RANK", "0")

    def watch() -> None:
        if not done.wait(seconds):
            on_timeout(
                f"error: rank {rank}: {what} did not finish within {seconds:g}s ({setting}): "
                "a peer rank or engine died or hangs; check train.log, then resume with --resume."
            )

    threading.Thread(target=watch, name=f"watchdog:{what}", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def bounded_step(
    what: str, seconds: float, run_dir: str | Path, rank: int, step: int
) -> contextlib.AbstractContextManager[None]:
    """``bounded`` for a wait of the training loop (``seconds``: parallel.timeout_s): the
    timeout is also this attempt's failure of ``step``, as an exception would be
    (restarts.py: the restarted attempt names it, a restart loop of hangs ends)."""

    def timed_out(line: str) -> None:
        hang = TimeoutError(f"{what} did not finish within {seconds:g}s (parallel.timeout_s)")
        note_failure(run_dir, rank, step, hang)
        exit_timeout(line)

    return bounded(what, seconds, "parallel.timeout_s bounds it", on_timeout=timed_out)
