"""The transport's point-to-point engine: post ``isend``/``irecv``, wait on them without ever
blocking a post, and the plan handshake.

- **Named operations.** Every posted operation is an ``Op`` (kind, peer, the torch ``Work``,
  and for a bucket its ``Bucket``, buffer slot and link), so an error names what it was.
- **Waiting, never silent.** Gloo's point-to-point works do not implement ``is_completed``
  (c10d ``ProcessGroupGloo::SendWork`` only overrides ``wait``), so each operation is waited
  on by a daemon thread (``Work.wait`` releases the GIL) that reports to a queue; the main
  thread stays free to post new operations while others are pending, which the windowed
  schedule needs. Every wait is ``Work.wait(timeout=timeout_s)``: under NCCL a plain
  ``wait()`` returns once the operation is enqueued on the stream (and a later ``.tolist()``
  would block without bound), while ``wait(timeout)`` blocks until the operation is done or
  raises; under gloo it raises on timeout too (tearing the connection down, as any failed
  sync leaves the group unusable). The main thread also gives up when nothing completed for
  ``timeout_s``: a stuck sync raises ``SyncError`` naming the peer, link and bucket.
- **Mismatched plans are caught up front.** On the first sync every pair of ranks that share
  a link exchanges a ``Header`` (plan fingerprint, element size, bucket size, bucket and
  element counts per direction); a difference raises ``PlanMismatchError`` before any weight
  moves. The lower rank of a pair sends first (NCCL's in-order stream per pair: docs/launch.md
  "NCCL rules").
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass
from datetime import timedelta
from typing import Any, ClassVar, NamedTuple

import torch
import torch.distributed as dist

from megatron_grpo.bridge.plan import SyncPlan
from megatron_grpo.bridge.schedule import Bucket, SyncError

# Gloo matches point-to-point messages by (peer, tag); buckets use their index as the tag,
# the handshake a tag no bucket index reaches. NCCL ignores tags and matches by order,
# which the schedule keeps identical on both sides.
_HANDSHAKE_TAG = 2**30


class PlanMismatchError(SyncError):
    """Two ranks were built from different plans (a config differs between them)."""


class Op(NamedTuple):
    """One posted point-to-point operation."""

    kind: str
    """``"send"`` or ``"recv"``."""
    peer: int
    work: Any
    """The torch ``Work`` that completes it."""
    bucket: Bucket | None = None
    """The bucket it moves (None for the handshake)."""
    slot: int = 0
    """Which of the link's buffers holds the bucket."""
    link: tuple[int, int] | None = None
    """``(src_rank, dst_rank)`` of the bucket's link."""


def plan_fingerprint(plan: SyncPlan) -> bytes:
    """sha256 of everything that decides the bytes on the wire (copies, shapes, dtype size)."""
    h = hashlib.sha256()
    h.update(f"es={plan.element_size};".encode())
    for d in plan.dst_tensors:
        h.update(f"T{d.rank}|{d.name}|{tuple(d.shape)};".encode())
    for c in plan.copies:
        h.update(
            f"C{c.src_rank}|{c.src_name}|{c.dst_rank}|{c.dst_name}|{c.dim}|"
            f"{c.src_start}|{c.dst_start}|{c.length};".encode()
        )
    return h.digest()


@dataclass(frozen=True)
class Header:
    """What two ranks that share a link exchange on the first sync: 13 int64 on the wire,
    in field order (``to_tensor`` / ``from_tensor``)."""

    MAGIC: ClassVar[int] = 0x6D67_7270  # "mgrp"
    VERSION: ClassVar[int] = 1
    LEN: ClassVar[int] = 13

    magic: int
    version: int
    rank: int
    """The sender of the header."""
    peer: int
    element_size: int
    bucket_bytes: int
    fingerprint_hi: int
    """Bits 66..127 of the first 16 bytes of the plan fingerprint (an int64 holds 62)."""
    fingerprint_lo: int
    """Bits 4..65 of the same."""
    out_buckets: int
    """Buckets on the link ``rank -> peer``."""
    out_elems: int
    in_buckets: int
    """Buckets on the link ``peer -> rank``."""
    in_elems: int
    copies: int
    """Copies in the whole plan (named when the fingerprints differ)."""

    @classmethod
    def of(
        cls,
        rank: int,
        peer: int,
        plan: SyncPlan,
        fingerprint: bytes,
        bucket_bytes: int,
        out_link: list[Bucket],
        in_link: list[Bucket],
    ) -> Header:
        fp = int.from_bytes(fingerprint[:16], "big")
        return cls(
            cls.MAGIC, cls.VERSION, rank, peer, plan.element_size, bucket_bytes,
            fp >> 66, (fp >> 4) & (2**62 - 1),
            len(out_link), sum(b.numel for b in out_link),
            len(in_link), sum(b.numel for b in in_link),
            len(plan.copies),
        )  # fmt: skip

    def to_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(astuple(self), dtype=torch.int64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Header:
        return cls(*t.tolist())


def check_header(rank: int, peer: int, mine: Header, theirs: Header) -> None:
    """Raise ``PlanMismatchError`` naming what differs between ``rank``'s header for ``peer``
    and the one ``peer`` sent."""
    if theirs.magic != Header.MAGIC or theirs.version != Header.VERSION:
        raise PlanMismatchError(
            f"rank {rank}: rank {peer} sent a plan header with magic/version "
            f"{[theirs.magic, theirs.version]} (expected {[Header.MAGIC, Header.VERSION]}): it "
            "runs another megatron-grpo version or is sending something else on this process "
            "group."
        )
    problems = []
    if theirs.element_size != mine.element_size:
        problems.append(
            f"element size {theirs.element_size} vs {mine.element_size} bytes (wire dtype differs)"
        )
    if theirs.bucket_bytes != mine.bucket_bytes:
        problems.append(
            f"bucket size {theirs.bucket_bytes} vs {mine.bucket_bytes} bytes (sync.bucket_mb "
            "differs)"
        )
    if (theirs.fingerprint_hi, theirs.fingerprint_lo) != (mine.fingerprint_hi, mine.fingerprint_lo):
        problems.append(
            f"plan fingerprint differs ({theirs.copies} vs {mine.copies} copies in the plan)"
        )
    # The peer's outgoing link is my incoming link and vice versa.
    if (theirs.out_buckets, theirs.out_elems) != (mine.in_buckets, mine.in_elems):
        problems.append(
            f"link {peer}->{rank}: rank {peer} will send {theirs.out_buckets} buckets / "
            f"{theirs.out_elems} elements, rank {rank} expects {mine.in_buckets} / "
            f"{mine.in_elems}"
        )
    if (theirs.in_buckets, theirs.in_elems) != (mine.out_buckets, mine.out_elems):
        problems.append(
            f"link {rank}->{peer}: rank {peer} expects {theirs.in_buckets} buckets / "
            f"{theirs.in_elems} elements, rank {rank} will send {mine.out_buckets} / "
            f"{mine.out_elems}"
        )
    if problems:
        raise PlanMismatchError(
            f"rank {rank} and rank {peer} were built from different sync plans: "
            + "; ".join(problems)
            + ". Both sides must build the plan from the same model, trainer TP/PP, "
            "rollout TP, rank placement, wire dtype and sync.bucket_mb."
        )


class _Waiters:
    """Daemon threads that wait on torch ``Work`` objects, kept across syncs: starting a
    thread per operation cost ~0.1-0.8 ms each, a visible part of a small model's sync.
    A job never waits for a free thread (one is started when none is idle), so the pool
    grows to the number of operations in flight and no wait queues behind another."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[Op], None], arg: Op) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                threading.Thread(target=self._run, daemon=True).start()
        self._jobs.put((fn, arg))

    def _run(self) -> None:
        while True:
            fn, arg = self._jobs.get()
            fn(arg)
            with self._lock:
                self._idle += 1


_WAITERS = _Waiters()
"""One pool for the process: a job carries its own callback and queue, so every transport
(a run's, a benchmark's one per bucket size) shares the same threads."""


class PointToPoint:
    """One rank's point-to-point traffic on ``group`` (None: the default group), every wait
    bounded by ``timeout_s``."""

    def __init__(self, rank: int, group: dist.ProcessGroup | None, timeout_s: float) -> None:
        self.rank = rank
        self.group = group
        self.timeout_s = timeout_s

    def post(
        self,
        kind: str,
        buf: torch.Tensor,
        peer: int,
        tag: int,
        bucket: Bucket | None = None,
        slot: int = 0,
        link: tuple[int, int] | None = None,
    ) -> Op:
        """Post ``buf``'s ``isend`` to ``peer`` (``kind="send"``) or ``irecv`` from it
        (``"recv"``); ``bucket``, ``slot``, ``link``: what the ``Op`` moves."""
        if kind == "send":
            work = dist.isend(buf, dst=peer, group=self.group, tag=tag)
        else:
            work = dist.irecv(buf, src=peer, group=self.group, tag=tag)
        return Op(kind, peer, work, bucket, slot, link)

    def wait_all(
        self,
        ops: list[Op],
        describe: Callable[[Op], str],
        on_done: Callable[[Op], None] | None = None,
    ) -> float:
        """Wait for every op in ``ops`` and every op ``on_done`` appends to ``ops`` after a
        completion, never blocking a post; returns the seconds spent blocked on the network.

        Raises ``SyncError`` (with ``describe(op)``) when an op fails or times out, or when
        nothing completed for ``timeout_s``; the process group is then unusable. The waiting
        threads are daemons (``_WAITERS``), so a rank that gave up can still exit.
        """
        done_q: queue.Queue = queue.Queue()
        bound = timedelta(seconds=self.timeout_s)

        def waiter(op: Op) -> None:
            try:
                op.work.wait(timeout=bound)  # NCCL: blocks until done (wait() only enqueues)
                done_q.put((op, None))
            except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
                done_q.put((op, exc))

        pending: dict[int, Op] = {}
        waited = 0.0

        def watch() -> None:
            for op in ops:
                pending[id(op)] = op
                _WAITERS.submit(waiter, op)
            ops.clear()

        watch()
        while pending:
            t_wait = time.perf_counter()
            try:
                op, exc = done_q.get(timeout=self.timeout_s)
            except queue.Empty:
                raise self._stalled(list(pending.values()), describe) from None
            waited += time.perf_counter() - t_wait
            del pending[id(op)]
            if exc is not None:  # a dead peer, or the op's own timeout
                raise SyncError(
                    f"rank {self.rank}: {describe(op)}; the operation failed or did not "
                    f"complete within {self.timeout_s:.1f}s (sync.timeout_s). The process "
                    f"group reported: {exc}"
                ) from exc
            if on_done is not None:
                on_done(op)
                watch()
        return waited

    def _stalled(self, pending: list[Op], describe: Callable[[Op], str]) -> SyncError:
        desc = ", ".join(describe(o) for o in pending[:4])
        more = f" (+{len(pending) - 4} more)" if len(pending) > 4 else ""
        return SyncError(
            f"rank {self.rank}: weight sync made no progress for {self.timeout_s:.1f}s "
            f"(sync.timeout_s): {desc}{more}. Check that the peer process is alive "
            "and called sync with the same plan; the process group is now unusable "
            "and must be destroyed."
        )

    def exchange_headers(self, mine: dict[int, Header], device: torch.device) -> None:
        """Send ``mine[peer]`` to every peer and check the header it sends back (ordered by
        rank: the lower rank sends first); raises ``PlanMismatchError`` on a difference."""
        out = {p: h.to_tensor(device) for p, h in mine.items()}
        theirs = {p: torch.zeros(Header.LEN, dtype=torch.int64, device=device) for p in mine}
        ops: list[Op] = []
        for p in mine:
            for kind in ("send", "recv") if self.rank < p else ("recv", "send"):
                buf = out[p] if kind == "send" else theirs[p]
                ops.append(self.post(kind, buf, p, _HANDSHAKE_TAG))
        self.wait_all(ops, self._handshake_failed)
        for p, h in mine.items():
            check_header(self.rank, p, h, Header.from_tensor(theirs[p]))

    def _handshake_failed(self, op: Op) -> str:
        peer = op.peer
        return (
            f"the plan handshake with rank {peer} ({op.kind}) did not complete: rank {peer} "
            "is not running Transport.run_plan (dead, stuck, or not started), or its plan "
            f"has no link with rank {self.rank} (the two sides were built from "
            "different configs: compare trainer TP/PP, rollout TP and rank placement)"
        )
