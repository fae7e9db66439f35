"""A small pool of worker processes that runs reward calls under per-call deadlines.

Why processes: ``math_verify``'s own timeout uses ``signal.alarm``, which works only in a
process's main thread, and a stuck sympy call cannot be interrupted from another thread.
A call that overruns its deadline here gets its worker killed (SIGKILL, by the pid of the
process this pool started) and replaced; the call scores as a timeout. The pool never
blocks longer than ``timeout_s`` on one call, whatever the input.

Workers are started with the ``spawn`` method (safe in a parent with threads, e.g. torch
or gloo) and import the target ``"package.module:function"`` once (and run its optional
``warmup_args`` call), before they report ready; time spent there never counts against a
call's deadline.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from megatron_grpo.config.plugins import load_object
from megatron_grpo.platform.lifetime import die_with_parent

log = logging.getLogger(__name__)

_MAX_DETAIL = 500


def load_callable(path: str) -> Callable:
    """Import ``"package.module:function"`` or ``"path/to/file.py:function"`` and return
    the function."""
    fn = load_object(path, "reward", "function", "reward.name=mypkg.rewards:score")
    if not callable(fn):
        raise ValueError(f"reward {path!r} is not callable (got {type(fn).__name__}).")
    return fn


def _worker_main(conn: Connection, target: str) -> None:
    # Launchers deliver pre-emption warnings (SIGUSR1/SIGTERM) to the trainer's whole process
    # group; the trainer checkpoints and stops its workers itself (SIGKILL, by pid), so a
    # worker must not die mid-step on that signal.
    die_with_parent()  # a SIGKILLed trainer runs no cleanup: its workers must not outlive it
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        fn = load_callable(target)
    except BaseException as e:  # report, then exit: the parent fails the build
        conn.send(("load_error", None, repr(e)[:_MAX_DETAIL]))
        return
    # A target may name a warm-up call (``fn.warmup_args``): lazy first-call setup, such as
    # math_verify building its LaTeX grammar, then happens before "ready", not under a deadline.
    warmup = getattr(fn, "warmup_args", None)
    if warmup is not None:
        try:
            fn(*warmup)
        except Exception:  # noqa: BLE001 - a failing warm-up shows up on real calls
            pass
    conn.send(("ready", None, None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if msg is None:
            return
        idx, args = msg
        try:
            value = float(fn(*args))
            conn.send(("ok", idx, value))
        except BaseException as e:  # noqa: BLE001 - any failure of user code scores 0
            conn.send(("error", idx, f"{type(e).__name__}: {str(e)[:_MAX_DETAIL]}"))


@dataclass
class Outcome:
    """Result of one call: ``status`` is ``ok`` (``value`` set), ``error`` or ``timeout``."""

    status: str
    value: float = 0.0
    detail: str = ""


class _Worker:
    def __init__(self, ctx, target: str) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, target), daemon=True)
        self.proc.start()
        child.close()
        self.started = time.monotonic()
        self.ready = False
        self.task: tuple[int, float] | None = None  # (index, deadline)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()


class DeadlinePool:
    """``num_workers`` processes running ``target(*args)`` with a ``timeout_s`` deadline per call.

    Use :meth:`map` for a batch; call :meth:`close` (or use as a context manager) to stop
    the workers. ``start_timeout_s`` bounds how long a worker may take to import the target.
    """

    def __init__(
        self,
        target: str,
        num_workers: int,
        timeout_s: float,
        start_timeout_s: float = 120.0,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1: set reward.num_workers.")
        self.target, self.timeout_s, self.start_timeout_s = target, timeout_s, start_timeout_s
        self._ctx = mp.get_context("spawn")
        self._workers = [_Worker(self._ctx, target) for _ in range(num_workers)]
        self.restarts = 0

    # ----------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        for w in self._workers:
            try:
                if w.proc.is_alive() and w.task is None and w.ready:
                    w.conn.send(None)
                    w.proc.join(timeout=2)
            except (OSError, ValueError):
                pass
            w.kill()
        self._workers = []

    def __enter__(self) -> DeadlinePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers if w.proc.pid is not None]

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers[self._workers.index(w)] = _Worker(self._ctx, self.target)
        self.restarts += 1

    def wait_ready(self, count: int | None = None) -> None:
        """Block until ``count`` (default: all) workers have imported the target.

        Waits at most ``start_timeout_s``. Optional: :meth:`map` dispatches to whichever
        workers are ready. The trainer calls
        this once at start so the first rollout's rewards do not wait for imports.
        """
        while True:
            starting = [w for w in self._workers if not w.ready]
            need = len(self._workers) if count is None else min(count, len(self._workers))
            if len(self._workers) - len(starting) >= need:
                return
            limit = min(w.started for w in starting) + self.start_timeout_s
            ready = wait([w.conn for w in starting], timeout=max(0.0, limit - time.monotonic()))
            if not ready:
                raise RuntimeError(
                    f"reward worker for {self.target!r} did not start within "
                    f"{self.start_timeout_s}s: the import is too slow or hangs."
                )
            for w in starting:
                if w.conn in ready:
                    try:
                        kind, _, payload = w.conn.recv()
                    except (EOFError, OSError):
                        raise RuntimeError(
                            f"reward worker for {self.target!r} exited while starting "
                            f"(exit code {w.proc.exitcode})."
                        ) from None
                    if kind == "load_error":
                        raise RuntimeError(f"reward worker cannot load {self.target!r}: {payload}")
                    w.ready = True

    # ----------------------------------------------------------------------------- map
    def map(self, args_list: Sequence[tuple]) -> list[Outcome]:
        """Run ``target(*args)`` for each ``args``; returns one :class:`Outcome` per call, in order."""
        if not self._workers:
            raise RuntimeError("DeadlinePool.map after close(): build a new pool.")
        results: list[Outcome | None] = [None] * len(args_list)
        pending = deque(enumerate(args_list))
        while pending or any(w.task is not None for w in self._workers):
            now = time.monotonic()
            for w in self._workers:
                if w.ready and w.task is None and pending:
                    idx, args = pending.popleft()
                    try:
                        w.conn.send((idx, tuple(args)))
                    except (OSError, ValueError, BrokenPipeError) as e:
                        results[idx] = Outcome("error", detail=f"send failed: {e}")
                        self._replace(w)
                        continue
                    w.task = (idx, time.monotonic() + self.timeout_s)
            deadlines = [w.task[1] for w in self._workers if w.task is not None]
            deadlines += [w.started + self.start_timeout_s for w in self._workers if not w.ready]
            if not deadlines:
                continue
            conns = [w.conn for w in self._workers if w.task is not None or not w.ready]
            for conn in wait(conns, timeout=max(0.0, min(deadlines) - now)):
                found = next((x for x in self._workers if x.conn is conn), None)
                if found is None:  # replaced earlier in this round
                    continue
                w = found
                try:
                    kind, idx, payload = w.conn.recv()
                except (EOFError, OSError):
                    if w.task is not None:
                        results[w.task[0]] = Outcome("error", detail="reward worker died")
                    elif not w.ready:
                        raise RuntimeError(
                            f"reward worker for {self.target!r} exited while starting "
                            f"(exit code {w.proc.exitcode})."
                        ) from None
                    self._replace(w)
                    continue
                if kind == "ready":
                    w.ready = True
                elif kind == "load_error":
                    raise RuntimeError(f"reward worker cannot load {self.target!r}: {payload}")
                else:
                    results[idx] = Outcome(
                        kind, payload if kind == "ok" else 0.0, "" if kind == "ok" else payload
                    )
                    w.task = None
            now = time.monotonic()
            for w in list(self._workers):
                if w.task is not None and now >= w.task[1]:
                    results[w.task[0]] = Outcome("timeout", detail=f"over {self.timeout_s}s")
                    self._replace(w)
                elif not w.ready and now >= w.started + self.start_timeout_s:
                    raise RuntimeError(
                        f"reward worker for {self.target!r} did not start within "
                        f"{self.start_timeout_s}s: the import is too slow or hangs."
                    )
        return [r if r is not None else Outcome("error", detail="lost") for r in results]
