"""Executes a ``SyncPlan``: every vLLM rank receives exactly its own shards, point to point,
from the trainer ranks that hold the pieces. ``Transport`` holds one rank's static state and
buffers, ``_Sync`` runs one sync; the schedule is ``bridge.schedule``, the point-to-point
engine ``bridge.p2p``, the bucket copies ``bridge.buckets``. Why it cannot deadlock under
NCCL's ordering, and how it overlaps: docs/bridge.md, "Transport".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from megatron_grpo.bridge.accounting import SyncStats, link_key
from megatron_grpo.bridge.buckets import Packer, copy_batched
from megatron_grpo.bridge.p2p import Header, Op, PointToPoint, plan_fingerprint
from megatron_grpo.bridge.plan import SyncPlan
from megatron_grpo.bridge.schedule import Bucket, SyncError, build_schedule, pair_order, slice_shape

Deliver = Callable[[str, torch.Tensor], None]
"""Takes each destination shard (vLLM name, tensor) as soon as it is complete."""

_DTYPES = {4: torch.float32, 2: torch.bfloat16, 8: torch.float64}


def wire_dtype(element_size: int, dtype: torch.dtype | None = None) -> torch.dtype:
    """``dtype``, or the default dtype of ``element_size`` bytes; checked against it."""
    if dtype is None:
        if element_size not in _DTYPES:
            raise ValueError(
                f"plan.element_size={element_size} has no default dtype; pass "
                f"dtype= (one of {sorted(_DTYPES)} bytes: {list(_DTYPES.values())})."
            )
        dtype = _DTYPES[element_size]
    if torch.empty((), dtype=dtype).element_size() != element_size:
        raise ValueError(
            f"dtype {dtype} has {torch.empty((), dtype=dtype).element_size()} bytes per "
            f"element but plan.element_size={element_size}: build the plan for the "
            "wire dtype you send."
        )
    return dtype


def _tiles(spans: list[tuple[int, int, int]], shape: tuple[int, ...]) -> bool:
    """Whether ``(dim, start, length)`` copies cover a tensor of ``shape`` exactly once."""
    if not spans or len({d for d, _, _ in spans}) != 1:
        return False
    end = 0
    for _, start, length in sorted(spans, key=lambda x: x[1]):
        if start != end:
            return False
        end = start + length
    return end == shape[spans[0][0]]


class _Link:
    """Mutable per-sync state of one network link, seen from one side."""

    def __init__(self, buckets: list[Bucket], buffers: list[torch.Tensor]) -> None:
        self.buckets = buckets
        self.buffers = buffers
        self.done: set[int] = set()  # bucket indices whose operation completed


class Transport:
    """Runs one ``SyncPlan`` again and again from one rank's point of view.

    Build one per rank and plan (``Transport(plan, rank, group=...)``), then call
    ``run_plan(sources, deliver)`` on every rank of the group at each weight push. Ranks with
    no link in the plan may skip ``run_plan``.
    """

    def __init__(
        self,
        plan: SyncPlan,
        rank: int,
        *,
        group: dist.ProcessGroup | None = None,
        bucket_mb: float = 64.0,
        timeout_s: float = 120.0,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        window: int = 2,
    ) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb={bucket_mb} must be > 0 (sync.bucket_mb).")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0 (sync.timeout_s).")
        if window < 1:
            raise ValueError(f"window={window} must be >= 1 (buckets in flight per link).")
        self.plan = plan
        self.rank = rank
        self.bucket_bytes = max(plan.element_size, int(bucket_mb * 2**20))
        self.timeout_s = float(timeout_s)
        self.device = torch.device(device)
        self.window = window
        self.dtype = wire_dtype(plan.element_size, dtype)
        self.p2p = PointToPoint(rank, group, self.timeout_s)
        self.packer = Packer(rank)
        self.fingerprint = plan_fingerprint(plan)

        self.schedule = build_schedule(plan, self.bucket_bytes)
        self.send_links = {k: v for k, v in self.schedule.items() if k[0] == rank}
        self.recv_links = {k: v for k, v in self.schedule.items() if k[1] == rank}
        self.local_copies = [c for c in plan.copies if c.src_rank == rank == c.dst_rank]
        self.dst_shapes = {d.name: tuple(d.shape) for d in plan.dst_tensors if d.rank == rank}
        self._local = [  # (copy, slice shape, what it feeds): colocated copies, per sync
            (
                c,
                slice_shape(self.dst_shapes[c.dst_name], c.dim, c.length),
                f"{c.dst_name!r} on rank {rank}",
            )
            for c in self.local_copies
        ]
        self._local_bytes = sum(plan.copy_bytes(c) for c in self.local_copies)
        self._pieces = self._count_pieces()
        self._tiled = self._find_tiled()
        self.peers = sorted({s for s, _ in self.recv_links} | {d for _, d in self.send_links})
        self._buffers: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._handshaken = False

    def _count_pieces(self) -> dict[str, int]:
        """How many pieces complete each destination shard on this rank (network entries +
        local copies); a shard is delivered when its count reaches zero."""
        pieces: dict[str, int] = dict.fromkeys(self.dst_shapes, 0)
        for buckets in self.recv_links.values():
            for b in buckets:
                for e in b.entries:
                    pieces[e.copy.dst_name] += 1
        for c in self.local_copies:
            pieces[c.dst_name] += 1
        return pieces

    def _find_tiled(self) -> dict[str, bool]:
        """Shards whose copies tile them exactly (one dim, disjoint, no gap) need no zero
        fill: allocating them empty saves a memset of every byte a sync delivers."""
        spans: dict[str, list[tuple[int, int, int]]] = {n: [] for n in self.dst_shapes}
        for c in self.plan.copies:
            if c.dst_rank == self.rank:
                spans[c.dst_name].append((c.dim, c.dst_start, c.length))
        return {n: _tiles(sp, self.dst_shapes[n]) for n, sp in spans.items()}

    # -- buffers ----------------------------------------------------------------------

    def _buffers_for(self, link: tuple[int, int]) -> list[torch.Tensor]:
        bufs = self._buffers.get(link)
        if bufs is None:
            n = max(b.numel for b in self.schedule[link])
            k = min(self.window, len(self.schedule[link]))
            bufs = [torch.empty(n, dtype=self.dtype, device=self.device) for _ in range(k)]
            self._buffers[link] = bufs
        return bufs

    @property
    def bucket_memory_bytes(self) -> int:
        """Bytes of flat buffers this rank holds for its links (allocated on first sync)."""
        total = 0
        for link in list(self.send_links) + list(self.recv_links):
            n = max(b.numel for b in self.schedule[link])
            total += min(self.window, len(self.schedule[link])) * n * self.plan.element_size
        return total

    # -- handshake --------------------------------------------------------------------

    def handshake(self) -> float:
        """Exchange plan headers with every peer; raise if any peer's plan differs."""
        t0 = time.perf_counter()
        mine = {
            p: Header.of(
                self.rank,
                p,
                self.plan,
                self.fingerprint,
                self.bucket_bytes,
                self.schedule.get((self.rank, p), []),
                self.schedule.get((p, self.rank), []),
            )
            for p in self.peers
        }
        self.p2p.exchange_headers(mine, self.device)
        self._handshaken = True
        return time.perf_counter() - t0

    # -- the sync ---------------------------------------------------------------------

    def run_plan(
        self,
        sources: Mapping[str, torch.Tensor],
        deliver: Deliver | None = None,
        finish: Callable[[], float | None] | None = None,
    ) -> tuple[SyncStats, dict[str, torch.Tensor]]:
        """Run this rank's part of the plan once (one weight sync). Collective over the ranks
        that share links.

        ``sources``: this rank's trainer shards by ``Copy.src_name`` (empty on a pure
        receiver). ``deliver(name, tensor)``: called with each destination shard of this
        rank as soon as it is complete (vLLM layout, zero where no copy writes).
        ``finish()``: called once after the last shard; it may return the seconds it
        measured itself (the vLLM side's post-load processing), else its wall time counts.
        Returns this rank's stats and the destination shards it built (empty when
        ``deliver`` took them). ``stats.sync_index`` is the caller's to set (the sender
        counts syncs).
        """
        t_start = time.perf_counter()
        st = SyncStats(rank=self.rank, method="direct", minimal_bytes=self.plan.minimal_bytes)
        if not self._handshaken and self.peers:
            st.handshake_s = self.handshake()
        run = _Sync(self, sources, deliver, st)
        for p in self.peers:
            run.advance(p)
        run.copy_local()  # while the first buckets are on the wire
        st.transfer_s = self.p2p.wait_all(run.ops, run.describe, run.on_done)
        missing = [n for n, k in run.remaining.items() if k != 0]
        if missing:  # cannot happen with a consistent schedule; guard the invariant anyway
            raise SyncError(f"rank {self.rank}: destination shards left incomplete: {missing[:5]}")
        if finish is not None:
            t0 = time.perf_counter()
            reported = finish()
            st.finish_s = float(reported) if reported is not None else time.perf_counter() - t0
        st.total_s = time.perf_counter() - t_start
        st.peak_bucket_bytes = self.bucket_memory_bytes
        return st, run.built


class _Sync:
    """One sync from one rank: the destination shards being built, each pair's progress
    through its ``pair_order`` and the stats. Its methods are the steps ``Transport.run_plan``
    takes; ``on_done`` runs after each operation completes and posts what it unblocked."""

    def __init__(
        self,
        tr: Transport,
        sources: Mapping[str, torch.Tensor],
        deliver: Deliver | None,
        st: SyncStats,
    ) -> None:
        self.tr, self.sources, self.deliver, self.st = tr, sources, deliver, st
        self.es = tr.plan.element_size
        self.remaining = dict(tr._pieces)
        self.built: dict[str, torch.Tensor] = {}
        # Destination shards no copy writes (all padding) are complete from the start.
        for name, n in self.remaining.items():
            if n == 0:
                self.dst(name)
                self.remaining[name] = 1
                self.piece_done(name)
        self.send = {k: _Link(v, tr._buffers_for(k)) for k, v in tr.send_links.items()}
        self.recv = {k: _Link(v, tr._buffers_for(k)) for k, v in tr.recv_links.items()}
        self.ops: list[Op] = []
        # Per peer, the canonical order both sides issue in, and how far this rank got; an
        # op whose buffer slot is busy holds back the rest of its pair.
        self.order = {
            p: pair_order(
                tr.rank,
                p,
                len(tr.send_links.get((tr.rank, p), ())),
                len(tr.recv_links.get((p, tr.rank), ())),
            )
            for p in tr.peers
        }
        self.cursor = dict.fromkeys(tr.peers, 0)

    def dst(self, name: str) -> torch.Tensor:
        """This rank's destination shard ``name``, allocated on first touch (so that shards
        delivered early can be freed)."""
        t = self.built.get(name)
        if t is None:
            tr = self.tr
            alloc = torch.empty if tr._tiled[name] else torch.zeros
            t = self.built[name] = alloc(tr.dst_shapes[name], dtype=tr.dtype, device=tr.device)
        return t

    def piece_done(self, name: str, n: int = 1) -> None:
        self.remaining[name] -= n
        if self.remaining[name] == 0:
            self.st.dst_bytes += self.built[name].numel() * self.es
            if self.deliver is not None:
                # ``deliver`` owns the shard from here: dropping our reference lets a
                # receiver that copies it free it before the sync ends.
                t0 = time.perf_counter()
                self.deliver(name, self.built.pop(name))
                self.st.load_s += time.perf_counter() - t0

    def advance(self, peer: int) -> None:
        """Post ``peer``'s next operations in pair order, up to one whose slot is busy."""
        tr, seq = self.tr, self.order[peer]
        while self.cursor[peer] < len(seq):
            kind, index = seq[self.cursor[peer]]
            if kind == "send":
                link, lk = (tr.rank, peer), self.send[(tr.rank, peer)]
            else:
                link, lk = (peer, tr.rank), self.recv[(peer, tr.rank)]
            if index >= len(lk.buffers) and index - len(lk.buffers) not in lk.done:
                return  # its slot still holds bucket index - window
            (self.post_send if kind == "send" else self.post_recv)(link, lk, index)
            self.cursor[peer] += 1

    def post_recv(self, link: tuple[int, int], lk: _Link, index: int) -> None:
        b, slot = lk.buckets[index], index % len(lk.buffers)
        buf = lk.buffers[slot][: b.numel]
        self.ops.append(self.tr.p2p.post("recv", buf, link[0], b.index, b, slot, link))

    def post_send(self, link: tuple[int, int], lk: _Link, index: int) -> None:
        st, es = self.st, self.es
        b, slot = lk.buckets[index], index % len(lk.buffers)
        t0 = time.perf_counter()
        flat = self.tr.packer.pack(self.sources, b, lk.buffers[slot])
        st.pack_s += time.perf_counter() - t0
        self.ops.append(self.tr.p2p.post("send", flat, link[1], b.index, b, slot, link))
        st.bytes_sent += b.numel * es
        st.buckets_sent += 1
        key = link_key(*link)
        st.bytes_per_link[key] = st.bytes_per_link.get(key, 0) + b.numel * es

    def copy_local(self) -> None:
        """The colocated copies (source shard -> destination shard, in this process)."""
        tr, st = self.tr, self.st
        t0 = time.perf_counter()
        outs, ins = [], []
        for c, shape, feeds in tr._local:
            ins.append(tr.packer.source(self.sources, c.src_name, c.dim, c.src_start, shape, feeds))
            t = self.dst(c.dst_name)
            outs.append(t if t.shape == shape else t.narrow(c.dim, c.dst_start, c.length))
        copy_batched(outs, ins)
        del outs, ins
        if tr.local_copies:
            st.bytes_local = tr._local_bytes
            st.bytes_per_link[link_key(tr.rank, tr.rank)] = st.bytes_local
        st.unpack_s += time.perf_counter() - t0
        for c in tr.local_copies:
            self.piece_done(c.dst_name)

    def on_done(self, op: Op) -> None:
        """A completed operation: unpack a received bucket, free its slot, post what next."""
        b = op.bucket
        # only bucket ops come here (the handshake waits without on_done): both are set
        assert b is not None and op.link is not None
        if op.kind == "recv":
            lk = self.recv[op.link]
            t0 = time.perf_counter()
            self.tr.packer.unpack(b, lk.buffers[op.slot], self.dst)
            self.st.unpack_s += time.perf_counter() - t0
            self.st.bytes_received += b.numel * self.es
            self.st.buckets_received += 1
            for name, n in b.dst_counts:
                self.piece_done(name, n)
        else:
            lk = self.send[op.link]
        lk.done.add(b.index)  # its buffer slot is free again
        self.advance(op.peer)

    def describe(self, op: Op) -> str:
        what = "receive from" if op.kind == "recv" else "send to"
        b, link = op.bucket, op.link
        # only bucket ops come here (the handshake has its own describe): both are set
        assert b is not None and link is not None
        return (
            f"{what} rank {op.peer} of bucket {b.index + 1}/{len(self.tr.schedule[link])} of "
            f"link {link[0]}->{link[1]} ({b.numel * self.es} bytes, first tensor "
            f"{b.entries[0].copy.dst_name!r})"
        )
