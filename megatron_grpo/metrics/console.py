"""What a training run prints: the project's own lines on the console, the rest in a file.

``capture(run_dir/train.log, rank)`` points this process's file descriptors 1 and 2 at a
pipe whose lines a thread appends to ``train.log``, prefixed ``[rank N]``: library warnings
(Apex / Transformer-Engine fallbacks), vLLM's INFO lines and its "Failed to load weights"
after every sync (vLLM's layerwise reload reports the buffers a sync does not send), the
resolved config, tracebacks. Child processes inherit the descriptors, so their output lands
there too. The project's lines (``say``), the progress bar and the summary go to
``console_out()`` / ``console_err()``, duplicates of the descriptors taken before the
redirection. Without ``capture`` (``train --verbose``) everything goes to the console.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from pathlib import Path
from typing import TextIO

LOG_FILE = "train.log"

_out: TextIO | None = None
_err: TextIO | None = None
_pump: threading.Thread | None = None
_log_path: Path | None = None


def console_out() -> TextIO:
    return _out or sys.stdout


def console_err() -> TextIO:
    return _err or sys.stderr


def log_path() -> Path | None:
    """The file the rest of the output goes to (None when not captured)."""
    return _log_path


def say(msg: str) -> None:
    """One line of the project's own, on the console (and in the log when captured)."""
    from tqdm import tqdm

    with tqdm.external_write_mode(file=console_err()):  # clear and redraw the progress bar
        print(f"[megatron-grpo] {msg}", file=console_out(), flush=True)
    if _out is not None:
        print(f"[megatron-grpo] {msg}", flush=True)


def say_rank0(ctx, msg: str) -> None:
    """``say`` on rank 0 of ``ctx`` (a ``ParallelContext``) only."""
    if ctx.rank == 0:
        say(msg)


def capture(path: str | os.PathLike, rank: int) -> None:
    """Send fd 1/2 of this process and its future children to ``path``, rank-prefixed."""
    global _out, _err, _pump, _log_path
    if _out is not None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    _out = os.fdopen(os.dup(1), "w", buffering=1)
    _err = os.fdopen(os.dup(2), "w", buffering=1)
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    sink = open(path, "ab", buffering=0)
    prefix = f"[rank {rank}] ".encode()

    def pump() -> None:
        with os.fdopen(read_fd, "rb", buffering=0) as src:
            pending = b""
            while chunk := src.read(65536):
                lines = (pending + chunk).split(b"\n")
                pending = lines.pop()
                if lines:
                    sink.write(b"".join(prefix + x + b"\n" for x in lines))
            if pending:
                sink.write(prefix + pending + b"\n")

    _pump = threading.Thread(target=pump, name="train.log", daemon=True)
    _pump.start()
    _log_path = path
    atexit.register(_drain)
    sys.excepthook = _excepthook


def _drain() -> None:
    """At exit: close our ends of the pipe so the thread writes what is left."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    if _pump is not None:
        _pump.join(timeout=2.0)  # children still holding the pipe keep it open: do not wait


def _excepthook(exc_type, exc, tb) -> None:
    """A crash: the traceback to train.log, one line pointing at it on the console."""
    sys.__excepthook__(exc_type, exc, tb)
    rank = os.environ.get("RANK", "0")
    detail = str(exc).splitlines()[0] if str(exc) else ""
    print(f"error: rank {rank} failed: {exc_type.__name__}: {detail[:300]} (traceback in "
          f"{_log_path})", file=console_err(), flush=True)  # fmt: skip
