"""Environment calls under time limits, side by side in threads (``env.timeout_s``,
``env.num_workers``).

A call that raises, returns the wrong types or overruns its limit ends its episode with
reward 0 and is counted; the first of each kind is logged once with its input. Nothing an
environment does stops the run. A call past its limit is abandoned, not killed (a thread
cannot be): its thread is a daemon that no exit waits for, and its slot is given to the next
call; an environment that may hang on CPU-bound work should run that work in a subprocess of
its own (docs/environments.md)."""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_grpo.environments.contract import check_step_result

log = logging.getLogger(__name__)

_DETAIL = 300


@dataclass
class EnvCounts:
    """What the environment calls of one batch came to."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0

    def add(self, other: EnvCounts) -> None:
        self.calls += other.calls
        self.errors += other.errors
        self.timeouts += other.timeouts


@dataclass
class Outcome:
    """One call's result: ``status`` ok, error or timeout; ``value`` what it returned
    (an environment for a build, ``(reply, reward)`` for a step)."""

    status: str
    value: Any = None
    detail: str = ""


@dataclass
class EnvRunner:
    """Builds and steps environments of class ``cls`` (``ClassName(row)``, ``step(text)``)."""

    cls: type
    timeout_s: float
    num_workers: int
    counts: EnvCounts = field(default_factory=EnvCounts)
    _logged: set[str] = field(default_factory=set)

    def build(self, rows: Sequence[dict]) -> list[Outcome]:
        """``cls(row)`` for every row."""
        calls = [functools.partial(self.cls, r) for r in rows]
        return self._run(calls, "ClassName(row)", rows)

    def step(self, envs: Sequence[Any], texts: Sequence[str]) -> list[Outcome]:
        """``env.step(text)`` of every pair; ``value`` is the checked ``(reply, reward)``."""
        calls = [functools.partial(_checked_step, e, t) for e, t in zip(envs, texts)]
        return self._run(calls, "step(text)", texts)

    def _run(
        self, calls: Sequence[Callable[[], Any]], what: str, inputs: Sequence[Any]
    ) -> list[Outcome]:
        out: list[Outcome | None] = [None] * len(calls)
        done: queue.SimpleQueue = queue.SimpleQueue()
        started: dict[int, float] = {}
        todo = list(range(len(calls)))[::-1]
        while todo or started:
            while todo and len(started) < self.num_workers:
                i = todo.pop()
                started[i] = time.monotonic()
                threading.Thread(target=_call, args=(calls[i], i, done), daemon=True,
                                 name="env-call").start()  # fmt: skip
            first = min(started.values())
            try:
                wait = max(0.0, first + self.timeout_s - time.monotonic())
                i, status, value, detail = done.get(timeout=wait)
            except queue.Empty:
                now = time.monotonic()
                for j, t0 in list(started.items()):
                    if now - t0 >= self.timeout_s:
                        del started[j]
                        out[j] = self._failed(
                            "timeout", what, inputs[j], f"took over env.timeout_s={self.timeout_s}"
                        )
                continue
            if i not in started:  # finished after its time was up: already counted
                continue
            del started[i]
            out[i] = Outcome("ok", value) if status == "ok" else self._failed(
                "error", what, inputs[i], detail)  # fmt: skip
        self.counts.calls += len(calls)
        assert all(o is not None for o in out)  # each call ends ok, in error or timed out
        return out  # type: ignore[return-value]

    def _failed(self, status: str, what: str, given: Any, detail: str) -> Outcome:
        if status == "timeout":
            self.counts.timeouts += 1
        else:
            self.counts.errors += 1
        if status not in self._logged:
            self._logged.add(status)
            shown = repr(given)
            shown = shown if len(shown) <= _DETAIL else shown[:_DETAIL] + "..."
            log.warning(
                "environment %s: %s %s (%s) on input %s; the episode ends with reward 0 "
                "(counted as env_%ss; logged once)", self.cls.__name__, what, status, detail,
                shown, status,
            )  # fmt: skip
        return Outcome(status, None, detail)


def _checked_step(env: Any, text: str) -> tuple[str | None, float | None]:
    return check_step_result(env.step(text))


def _call(fn: Callable[[], Any], i: int, done: queue.SimpleQueue) -> None:
    try:
        done.put((i, "ok", fn(), ""))
    except BaseException as e:  # noqa: BLE001 - an environment's failure ends its episode
        done.put((i, "error", None, f"{type(e).__name__}: {e}"[:_DETAIL]))
