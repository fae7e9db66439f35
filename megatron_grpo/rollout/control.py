"""The control channel of the disaggregated placement (rollout/server.py): small messages
(data, never code: rollout/messages.py) over ZeroMQ, one inbox per process, and heartbeats,
so a wait for a dead or hung peer ends in a clear error (``PeerGone``), never a hang.
Design notes (sockets, addresses, heartbeats): docs/rollout.md, "The control channel"."""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import zmq

from megatron_grpo.rollout.messages import MAX_MESSAGE_BYTES, Message, decode, too_large

log = logging.getLogger(__name__)

_PREFIX = "megatron_grpo/ctl/"
_HEARTBEAT_S = 2.0
_BEAT = b"hb"
"""The key of a heartbeat frame: it only says its sender is alive."""
_LINGER_MS = 5000
"""How long closing waits to deliver what was posted (the last ``stop``, an ``error``)."""
TRAINER = "trainer"
"""The channel name of trainer rank 0."""


class PeerGone(RuntimeError):
    """The other side of the control channel stopped beating."""


def engine_peer(e: int) -> str:
    """The channel name of engine ``e``'s driver."""
    return f"engine/{e}"


def rank_peer(rank: int) -> str:
    """The channel name of a rollout rank beside its engine's driver."""
    return f"rank/{rank}"


def node_address(world_size: int, override: str) -> str:
    """This node's address as the job's other processes reach it: ``$override`` when set,
    127.0.0.1 when the whole job runs on this node, else the node's resolved hostname."""
    explicit = os.environ.get(override)
    if explicit:
        return explicit
    if int(os.environ.get("LOCAL_WORLD_SIZE", "0")) == world_size:
        return "127.0.0.1"  # one node
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.getfqdn()


class Channel:
    """One process's end: an inbox (a PULL socket bound on ``host``, its address and token
    published once in ``store`` under its ``name``) and a PUSH socket per peer posted to.
    Every frame carries the receiver's token; one without it is dropped with a warning."""

    def __init__(
        self,
        store: Any,
        name: str,
        timeout_s: float,
        host: str = "127.0.0.1",
        max_bytes: int = MAX_MESSAGE_BYTES,
        silent_s: float | None = None,
    ) -> None:
        self.store = dist.PrefixStore(_PREFIX, store)
        self.name, self.timeout_s, self.max_bytes = name, timeout_s, max_bytes
        self._silent_s = silent_s
        self._ctx = zmq.Context()
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.bind(f"tcp://{host}:*")
        self._token = secrets.token_bytes(16)
        address = self._inbox.getsockopt_string(zmq.LAST_ENDPOINT)
        self.store.set(f"inbox/{name}", f"{address} {self._token.hex()}")
        self._out: dict[str, tuple[zmq.Socket, bytes]] = {}
        self._arrived: dict[str, tuple[str, memoryview]] = {}  # key -> (sender, data)
        self._seen: dict[str, float] = {}  # sender -> when its last frame arrived
        self._beat_stop = threading.Event()
        self._beat_thread: threading.Thread | None = None
        self.closed = False

    @property
    def silent_s(self) -> float:
        """A peer heard from once and then silent this long is gone (``silent_s``:
        parallel.heartbeat_timeout_s; never longer than ``timeout_s``)."""
        return min(self._silent_s or self.timeout_s, self.timeout_s)

    # -------------------------------------------------------------------------- sending
    def post(self, to: str | list[str], key: str, data: bytes) -> None:
        """Send one encoded message (``rollout.messages``: ``command``, ``samples``, ...)
        under ``key`` to the peer(s) ``to``; returns once queued (zmq sends it on)."""
        if len(data) > self.max_bytes:
            raise ValueError(f"control message {key!r} not sent: {too_large(data, self.max_bytes)}")
        for peer in [to] if isinstance(to, str) else to:
            sock, token = self._out.get(peer) or self._connect(peer)
            sock.send_multipart([token, self.name.encode(), key.encode(), data], copy=False)

    def _connect(self, peer: str) -> tuple[zmq.Socket, bytes]:
        address, token = self._address(peer)
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, _LINGER_MS)
        sock.connect(address)
        self._out[peer] = (sock, token)
        return sock, token

    def _address(self, peer: str) -> tuple[str, bytes]:
        """``peer``'s inbox address and token: one blocking read of the store."""
        key = f"inbox/{peer}"
        try:
            self.store.wait([key], timedelta(seconds=self.timeout_s))
        except (RuntimeError, dist.DistError) as e:  # DistStoreError: the wait timed out
            raise PeerGone(
                f"waited {self.timeout_s:.0f}s (parallel.timeout_s) for {peer!r} to publish its "
                f"control address in the rendezvous store ({type(e).__name__}): that process "
                "never started or died at start. Check its log; the other ranks stop."
            ) from None
        address, _, token = self.store.get(key).decode().partition(" ")
        return address, bytes.fromhex(token)

    def beat_forever(self, to: list[str]) -> None:
        """Send a heartbeat to each peer of ``to`` every few seconds, from a thread with its
        own sockets (zmq sockets are not thread-safe), until ``stop_beating``."""
        targets = [self._address(p) for p in to]
        self._beat_thread = threading.Thread(
            target=self._beat, args=(targets,), name=f"heartbeat-{self.name}", daemon=True
        )
        self._beat_thread.start()

    def _beat(self, targets: list[tuple[str, bytes]]) -> None:
        socks = []
        for address, token in targets:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 4)  # a peer that reads nothing holds a few beats
            sock.connect(address)
            socks.append((sock, token))
        try:
            while True:
                for sock, token in socks:
                    try:
                        sock.send_multipart([token, self.name.encode(), _BEAT, b""], zmq.NOBLOCK)
                    except zmq.Again:  # that peer's queue is full: it reads nothing
                        pass
                if self._beat_stop.wait(_HEARTBEAT_S):
                    return
        finally:
            for sock, _ in socks:
                sock.close()

    def stop_beating(self) -> None:
        self._beat_stop.set()
        if self._beat_thread is not None:
            self._beat_thread.join()
            self._beat_thread = None

    # -------------------------------------------------------------------------- receiving
    def wait(self, key: str, alive: list[str], what: str, expect: tuple[str, ...]) -> Message:
        """The message under ``key`` once it arrives, of one of the kinds ``expect``-ed (else
        ``BadMessage``); raises ``PeerGone`` when a peer of ``alive`` has sent nothing (no
        heartbeat) for ``timeout_s`` (a peer that never started counts), or on an ``abort``.
        Blocks in the inbox's poll between arrivals: no polling loop."""
        start = time.monotonic()
        while key not in self._arrived:
            if "abort" in self._arrived:
                reason = self._take("abort", f"the abort, waiting for {what}", ("abort",))
                raise PeerGone(f"gave up waiting for {what}: {reason.body}")
            due = {p: self._due(p, start) for p in alive}
            now = time.monotonic()
            for p, t in due.items():
                if now > t:
                    waited = (f"{self.silent_s:g}s (parallel.heartbeat_timeout_s)" if p in
                              self._seen else f"{self.timeout_s:.0f}s (parallel.timeout_s)")  # fmt: skip
                    raise PeerGone(
                        f"waited {waited} for {what}, and heartbeat {'hb/' + p!r} stopped: "
                        "that process died or hangs. Check its log; the other ranks stop."
                    )
            if not alive and now > start + self.timeout_s:
                raise PeerGone(f"waited {self.timeout_s:.0f}s (parallel.timeout_s) for {what}")
            self._receive(min(due.values(), default=start + self.timeout_s) - now)
        return self._take(key, what, expect)

    def _due(self, peer: str, start: float) -> float:
        """When ``peer``'s silence makes it gone: ``silent_s`` after its last frame (or the
        wait's start) once it has been heard from, ``timeout_s`` while it may be starting."""
        last = self._seen.get(peer)
        if last is None:
            return start + self.timeout_s
        return max(last, start) + self.silent_s

    def _receive(self, timeout_s: float) -> None:
        """Block until a frame arrives (at most ``timeout_s``), then file every waiting one."""
        if not self._inbox.poll(max(1, int(timeout_s * 1000) + 1)):
            return
        while True:
            try:
                frames = self._inbox.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 4 or not hmac.compare_digest(frames[0].bytes, self._token):
                log.warning(
                    "control channel %s: dropped a frame from %s without this job's token "
                    "(another process reached its port: keep it private, docs/launch.md)",
                    self.name, frames[0].get("Peer-Address"),
                )  # fmt: skip
                continue
            sender, key = frames[1].bytes.decode(errors="replace"), frames[2].bytes
            self._seen[sender] = time.monotonic()
            if key != _BEAT:
                self._arrived[key.decode(errors="replace")] = (sender, frames[3].buffer)

    def _take(self, key: str, what: str, expect: tuple[str, ...]) -> Message:
        _, data = self._arrived.pop(key)
        return decode(data, key, what, expect, self.max_bytes)

    def close(self) -> None:
        """Stop beating; close the sockets (delivering what was posted, for up to 5 s)
        and the context. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.stop_beating()
        for sock, _ in self._out.values():
            sock.close()
        self._inbox.close()
        self._ctx.term()
