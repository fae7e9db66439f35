"""The control channel of the disaggregated placement (rollout/server.py): small pickled
messages and heartbeat counters in torchrun's rendezvous store, so a wait for a dead or hung
peer ends in a clear error (``PeerGone``), never a hang."""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any

import torch.distributed as dist

_PREFIX = "megatron_grpo/ctl/"
_HEARTBEAT_S = 2.0
_POLL_S = 0.02


class PeerGone(RuntimeError):
    """The other side of the control channel stopped beating."""


class Channel:
    """Pickled messages and heartbeats in a key-value store (the control channel)."""

    def __init__(self, store: Any, timeout_s: float) -> None:
        self.store = dist.PrefixStore(_PREFIX, store)
        self.timeout_s = timeout_s
        self._beat_stop = threading.Event()

    def post(self, key: str, obj: Any) -> None:
        self.store.set(key, pickle.dumps(obj))

    def beat_forever(self, key: str) -> None:
        """Bump ``key`` every few seconds from a daemon thread until ``stop_beating``."""
        self.store.add(key, 1)
        threading.Thread(target=self._beat, args=(key,), name=f"heartbeat-{key}",
                         daemon=True).start()  # fmt: skip

    def _beat(self, key: str) -> None:
        while not self._beat_stop.is_set():
            try:
                self.store.add(key, 1)
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                return
            self._beat_stop.wait(_HEARTBEAT_S)

    def stop_beating(self) -> None:
        self._beat_stop.set()

    def wait(self, key: str, alive: list[str], what: str, take: bool = True) -> Any:
        """The object at ``key`` once posted; raises ``PeerGone`` when any heartbeat in
        ``alive`` has not moved for ``timeout_s`` (a peer that never started counts)."""
        last = {k: (self.store.add(k, 0), time.monotonic()) for k in alive}
        while not self.store.check([key]):
            if self.store.check(["abort"]):
                reason = pickle.loads(self.store.get("abort"))
                raise PeerGone(f"gave up waiting for {what}: {reason}")
            now = time.monotonic()
            for k in alive:
                value = self.store.add(k, 0)
                if value != last[k][0]:
                    last[k] = (value, now)
                elif now - last[k][1] > self.timeout_s:
                    raise PeerGone(
                        f"waited {self.timeout_s:.0f}s (parallel.timeout_s) for {what}, and "
                        f"heartbeat {k!r} stopped: that process died or hangs. Check its log; "
                        "the other ranks stop."
                    )
            time.sleep(_POLL_S)
        value = pickle.loads(self.store.get(key))
        if take:
            self.store.delete_key(key)
        return value


def trainer_beat() -> str:
    """The heartbeat key of trainer rank 0."""
    return "hb/trainer"


def engine_beat(e: int) -> str:
    """The heartbeat key of engine ``e``'s driver."""
    return f"hb/engine/{e}"
