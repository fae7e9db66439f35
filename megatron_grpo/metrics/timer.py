"""Wall-clock timing of named step phases.

    timer = PhaseTimer.for_device(ctx.device)   # synchronizes CUDA at phase boundaries
    with timer.phase("rollout"):
        ...
    metrics.update(timer.times())      # {"time_rollout": 1.2, ...}
    timer.reset()

GPU work is asynchronous: without a ``sync`` call at the phase boundaries the time of a
kernel lands in whichever later phase first waits for it. The trainer passes the device's
synchronize function; on CPU there is nothing to wait for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch


class PhaseTimer:
    """Accumulates seconds per phase name; a phase entered twice in a step adds up."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self._sync = sync
        self._totals: dict[str, float] = {}
        self._open: set[str] = set()

    @classmethod
    def for_device(cls, device: torch.device) -> PhaseTimer:
        """A timer that waits for ``device`` at every phase boundary: CUDA's
        ``synchronize`` of that device on a GPU, nothing on CPU."""
        if device.type == "cuda":
            return cls(sync=partial(torch.cuda.synchronize, device))
        return cls()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name in self._open:
            raise RuntimeError(
                f"phase {name!r} is already being timed: phases must not nest in themselves."
            )
        self._open.add(name)
        if self._sync is not None:
            self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            self._totals[name] = self._totals.get(name, 0.0) + time.perf_counter() - start
            self._open.discard(name)

    def elapsed(self, name: str) -> float:
        """Seconds spent in ``name`` since the last reset (0.0 if never entered)."""
        return self._totals.get(name, 0.0)

    def times(self, prefix: str = "time_") -> dict[str, float]:
        """``{prefix + name: seconds}`` for every phase timed since the last reset."""
        return {prefix + name: seconds for name, seconds in self._totals.items()}

    def reset(self) -> None:
        if self._open:
            raise RuntimeError(f"reset() while phases {sorted(self._open)} are still open.")
        self._totals.clear()
