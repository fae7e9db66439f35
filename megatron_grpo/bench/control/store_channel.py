"""The control channel as it was before pyzmq (rollout/control.py at 5a9dd28): messages and
heartbeat counters in torchrun's rendezvous store, waits polling it every 20 ms. Kept, verbatim,
only so ``bench control`` measures it beside the channel the job runs on."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch.distributed as dist

from megatron_grpo.rollout.messages import MAX_MESSAGE_BYTES, Message, decode, too_large

_PREFIX = "megatron_grpo/ctl/"
_HEARTBEAT_S = 2.0
_POLL_S = 0.02


class PeerGone(RuntimeError):
    """The other side of the control channel stopped beating."""


class Channel:
    """Messages (``rollout.messages``) and heartbeats in a key-value store."""

    def __init__(self, store: Any, timeout_s: float, max_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.store = dist.PrefixStore(_PREFIX, store)
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._beat_stop = threading.Event()

    def post(self, key: str, data: bytes) -> None:
        """Store one encoded message (``rollout.messages``: ``command``, ``samples``, ...)."""
        if len(data) > self.max_bytes:
            raise ValueError(f"control message {key!r} not sent: {too_large(data, self.max_bytes)}")
        # the stub says str, but the binding takes bytes (std::string) and get returns them
        self.store.set(key, data)  # type: ignore[arg-type]

    def beat_forever(self, key: str) -> None:
        """Bump ``key`` every few seconds from a daemon thread until ``stop_beating``."""
        self.store.add(key, 1)
        threading.Thread(
            target=self._beat, args=(key,), name=f"heartbeat-{key}", daemon=True
        ).start()

    def _beat(self, key: str) -> None:
        while not self._beat_stop.is_set():
            try:
                self.store.add(key, 1)
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                return
            self._beat_stop.wait(_HEARTBEAT_S)

    def stop_beating(self) -> None:
        self._beat_stop.set()

    def wait(
        self, key: str, alive: list[str], what: str, expect: tuple[str, ...], take: bool = True
    ) -> Message:
        """The message at ``key`` once posted, of one of the kinds ``expect``-ed (else
        ``BadMessage``); raises ``PeerGone`` when any heartbeat in ``alive`` has not moved
        for ``timeout_s`` (a peer that never started counts)."""
        last = {k: (self.store.add(k, 0), time.monotonic()) for k in alive}
        while not self.store.check([key]):
            if self.store.check(["abort"]):
                reason = self._read("abort", f"the abort, waiting for {what}", ("abort",))
                raise PeerGone(f"gave up waiting for {what}: {reason.body}")
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
        message = self._read(key, what, expect)
        if take:
            self.store.delete_key(key)
        return message

    def _read(self, key: str, what: str, expect: tuple[str, ...]) -> Message:
        return decode(self.store.get(key), key, what, expect, self.max_bytes)
