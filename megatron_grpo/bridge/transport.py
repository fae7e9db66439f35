"""Executes a ``SyncPlan``: every vLLM rank receives exactly its own shards, point to point,
from the trainer ranks that hold the pieces.

What the anchors do instead (verl, NeMo-RL, slime; DESIGN.md §2, §5) is gather full HF
tensors on one rank and broadcast them; the complaints in their trackers are the rank-0
funnel, per-tensor RPC overhead and silent hangs. This module answers each:

- **Static schedule, built once.** For every link (src_rank -> dst_rank) the plan's copies
  are laid out, in plan order, into flat buckets of at most ``bucket_mb``; a copy larger
  than the room left is split by rows along its own dim. Sender and receiver derive the
  same layout from the same plan, so only raw bytes travel on every sync: no names, no
  shapes, no per-tensor messages.
- **Flat packed buckets, reused.** Each rank keeps ``window`` bucket buffers per link and
  reuses them across syncs.
- **A few batched copies per bucket.** One ``copy_`` per slice costs a Python call and a
  kernel launch each: on an H100 that held the pack at 78 GB/s against 1,359 GB/s for a
  device copy of the same bytes (tests/gpu/test_gpu.py ``test_bridge_pack_unpack_bandwidth``,
  Qwen2.5-0.5B, 242 slices on one link). So the schedule also merges each bucket's entries
  into runs (``Run``: neighbouring entries that are one row range of one tensor on that
  side: q/k/v of a group, gate+up, a whole shard), the buffer's views of every run are made
  once and cached, and a bucket moves in one ``torch._foreach_copy_`` per source dtype
  (``_copy_batched``): CUDA's multi-tensor kernel for the contiguous runs, torch's own C++
  loop for the strided ones (the dim-1 slices of row-parallel weights). On CPU that loop is
  the same ``copy_`` per run as before, without the Python around each.
- **No funnel.** Links run concurrently; a rank never holds more than the destination
  shards it builds plus its bucket buffers.
- **Overlap.** With ``window=2`` the next bucket of a link is packed while the current one
  is on the wire, and a received bucket is unpacked while the next one arrives.
- **Colocated links** (src_rank == dst_rank: a trainer process hosting its vLLM rank) copy
  straight from the source shard into the destination shard, no buffer, no send.
- **Deadlock-free under NCCL's ordering, never silent.** NCCL runs the operations between
  two ranks on one stream in issue order (DESIGN.md §6; docs/launch.md "NCCL rules"), so
  both ranks of a pair issue their operations to each other in the same canonical order:
  round ``r`` is bucket ``r`` of the lower rank's link to the higher, then bucket ``r`` of
  the reverse link (``pair_order``); the first ``window`` rounds are posted before any
  wait, and an operation whose buffer slot is still busy (bucket ``r - window`` of its
  link not done) holds back the rest of that pair's sequence. Each operation's
  precondition is an earlier operation of the same sequence on both sides, so every
  posted operation's peer operation is eventually posted (induction on the position),
  whatever the mix of sending and receiving ranks; pairs are independent. Every wait is
  ``Work.wait(timeout=timeout_s)``, which under NCCL blocks until the operation is done
  (plain ``wait()`` only enqueues) and under gloo raises on timeout, and the main thread
  also gives up when nothing completed for ``timeout_s``: a stuck sync raises
  ``SyncError`` naming the peer, link and bucket.
- **Mismatched plans are caught up front.** On the first sync every pair of ranks that
  share a link exchanges a small header (plan fingerprint, element size, bucket size,
  bucket and element counts per direction); a difference raises ``PlanMismatchError``
  before any weight moves.
"""

from __future__ import annotations

import hashlib
import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_grpo.bridge.accounting import SyncStats, link_key
from megatron_grpo.bridge.plan import Copy, SyncPlan, row_elems

Sink = Callable[[str, torch.Tensor], None]
"""Receives each destination shard (vLLM name, tensor) as soon as it is complete."""

_HEADER_MAGIC = 0x6D67_7270  # "mgrp"
_HEADER_VERSION = 1
_HEADER_LEN = 13
# Gloo matches point-to-point messages by (peer, tag); buckets use their index as the tag,
# the handshake a tag no bucket index reaches. NCCL ignores tags and matches by order,
# which the schedule keeps identical on both sides.
_HANDSHAKE_TAG = 2**30

_DTYPES = {4: torch.float32, 2: torch.bfloat16, 8: torch.float64}


class SyncError(RuntimeError):
    """A weight sync could not complete (peer missing, timeout, wrong inputs)."""


class PlanMismatchError(SyncError):
    """Two ranks were built from different plans (a config differs between them)."""


@dataclass(frozen=True)
class Entry:
    """One (piece of a) copy inside a bucket: ``numel`` elements at ``offset``."""

    copy: Copy
    """The copy, restricted to the rows this entry carries (split copies get sub-ranges)."""
    offset: int
    numel: int
    shape: tuple[int, ...]
    """Shape of the slice: the destination's shape with ``copy.dim`` set to ``copy.length``."""


@dataclass(frozen=True)
class Run:
    """Neighbouring entries of a bucket that are one slice of one tensor on one side (the
    source tensor when packing, the destination when unpacking): what one batched copy moves.

    Entries merge when they read (or write) consecutive rows along the same dim and every
    dim before it has size 1, so that the rows' elements follow each other in row-major
    order exactly as the entries do in the bucket (dim 0 always qualifies)."""

    name: str
    dim: int
    start: int
    length: int
    shape: tuple[int, ...]
    """Shape of the slice: the entries' shape with ``dim`` set to ``length``."""
    offset: int
    numel: int
    feeds: str
    """Where the run's first entry goes (``'name' on rank r``), for error messages."""


def _runs(entries: Sequence[Entry], side: str) -> tuple[Run, ...]:
    """``entries`` (back to back in a bucket) merged into runs on ``side`` ("src"/"dst")."""
    out: list[Run] = []
    for e in entries:
        c = e.copy
        name, start = (c.src_name, c.src_start) if side == "src" else (c.dst_name, c.dst_start)
        prev = out[-1] if out else None
        if (
            prev is not None
            and prev.name == name
            and prev.dim == c.dim
            and prev.start + prev.length == start
            and prev.offset + prev.numel == e.offset
            and prev.shape[: c.dim] == e.shape[: c.dim]
            and prev.shape[c.dim + 1 :] == e.shape[c.dim + 1 :]
            and math.prod(e.shape[: c.dim]) == 1
        ):
            length = prev.length + c.length
            shape = _slice_shape(prev.shape, c.dim, length)
            out[-1] = Run(
                name, c.dim, prev.start, length, shape, prev.offset, prev.numel + e.numel,
                prev.feeds,
            )  # fmt: skip
        else:
            feeds = f"{c.dst_name!r} on rank {c.dst_rank}"
            out.append(Run(name, c.dim, start, c.length, e.shape, e.offset, e.numel, feeds))
    return tuple(out)


@dataclass(frozen=True)
class Bucket:
    """One flat message on a link (the schedule's key): its ``entries`` back to back,
    ``numel`` elements in all."""

    index: int
    """Position on the link, in the order both sides issue; also the gloo message tag."""
    entries: tuple[Entry, ...]
    numel: int
    pack_runs: tuple[Run, ...] = ()
    """The entries merged by source tensor: what the sender copies in (``_runs``)."""
    unpack_runs: tuple[Run, ...] = ()
    """The entries merged by destination tensor: what the receiver copies out."""
    dst_counts: tuple[tuple[str, int], ...] = ()
    """(destination name, entries of it in this bucket): the receiver's completion count."""


def _bucket(index: int, entries: Sequence[Entry], numel: int) -> Bucket:
    counts = Counter(e.copy.dst_name for e in entries)
    return Bucket(
        index, tuple(entries), numel, _runs(entries, "src"), _runs(entries, "dst"),
        tuple(counts.items()),
    )  # fmt: skip


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


def _slice_shape(shape: tuple[int, ...], dim: int, length: int) -> tuple[int, ...]:
    out = list(shape)
    out[dim] = length
    return tuple(out)


def build_schedule(plan: SyncPlan, bucket_bytes: int) -> dict[tuple[int, int], list[Bucket]]:
    """Lay each network link's copies (plan order) into flat buckets of <= ``bucket_bytes``.

    Pure and deterministic: sender and receiver compute the same schedule from the same
    plan. A copy that does not fit in the room left is split by rows along its dim; a
    single row larger than a bucket gets a bucket of its own. In-process links
    (src == dst) are not bucketed.
    """
    shapes = {(d.rank, d.name): tuple(d.shape) for d in plan.dst_tensors}
    cap = max(1, bucket_bytes // plan.element_size)
    per_link: dict[tuple[int, int], list[Copy]] = {}
    for c in plan.copies:
        if (c.dst_rank, c.dst_name) not in shapes:
            raise SyncError(
                f"plan copy {c.src_name!r} (rank {c.src_rank}) -> {c.dst_name!r} (rank "
                f"{c.dst_rank}) has no DstTensor; the plan builder must list every "
                "destination shard in plan.dst_tensors."
            )
        if c.src_rank != c.dst_rank:
            per_link.setdefault((c.src_rank, c.dst_rank), []).append(c)

    schedule: dict[tuple[int, int], list[Bucket]] = {}
    for (src, dst), copies in sorted(per_link.items()):
        buckets: list[Bucket] = []
        entries: list[Entry] = []
        fill = 0

        def close(buckets: list[Bucket] = buckets) -> None:
            nonlocal entries, fill
            if entries:
                buckets.append(_bucket(len(buckets), entries, fill))
            entries, fill = [], 0

        for c in copies:
            shape = shapes[(c.dst_rank, c.dst_name)]
            row = row_elems(shape, c.dim)
            done = 0
            while done < c.length:
                room_rows = (cap - fill) // row if row else c.length
                if room_rows == 0:
                    if entries:
                        close()
                        continue
                    room_rows = 1  # a single row larger than a bucket: its own bucket
                n = min(room_rows, c.length - done)
                part = Copy(
                    c.src_rank,
                    c.src_name,
                    c.dst_rank,
                    c.dst_name,
                    c.dim,
                    c.src_start + done,
                    c.dst_start + done,
                    n,
                )
                entries.append(Entry(part, fill, n * row, _slice_shape(shape, c.dim, n)))
                fill += n * row
                done += n
                if fill >= cap:
                    close()
        close()
        schedule[(src, dst)] = buckets
    return schedule


def apply_plan_locally(
    plan: SyncPlan,
    sources: Mapping[int, Mapping[str, torch.Tensor]],
    dtype: torch.dtype | None = None,
) -> dict[tuple[int, str], torch.Tensor]:
    """Reference executor: every destination shard built in one process, copy by copy.

    ``sources[rank][src_name]`` are the trainer shards; returns ``{(rank, name): tensor}``,
    zero where no copy writes (vocabulary padding). Tests compare the transport with it.
    """
    dtype = dtype or _DTYPES[plan.element_size]
    out = {(d.rank, d.name): torch.zeros(d.shape, dtype=dtype) for d in plan.dst_tensors}
    for c in plan.copies:
        src = sources[c.src_rank][c.src_name].narrow(c.dim, c.src_start, c.length)
        out[(c.dst_rank, c.dst_name)].narrow(c.dim, c.dst_start, c.length).copy_(src)
    return out


def pair_order(me: int, peer: int, out_buckets: int, in_buckets: int) -> list[tuple[str, int]]:
    """The order in which ``me`` issues its operations to ``peer``: ``("send"|"recv", b)``.

    Round ``r``: bucket ``r`` of the link lower rank -> higher rank, then bucket ``r`` of
    the link higher -> lower. Both ranks derive the same sequence (one's send is the
    other's receive at the same position), which is what NCCL's in-order point-to-point
    stream between two ranks needs.
    """
    lo_to_hi, hi_to_lo = (out_buckets, in_buckets) if me < peer else (in_buckets, out_buckets)
    first, second = ("send", "recv") if me < peer else ("recv", "send")
    seq = []
    for r in range(max(lo_to_hi, hi_to_lo)):
        if r < lo_to_hi:
            seq.append((first, r))
        if r < hi_to_lo:
            seq.append((second, r))
    return seq


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


class _Waiters:
    """Daemon threads that wait on torch ``Work`` objects, kept across syncs: starting a
    thread per operation cost ~0.1-0.8 ms each, a visible part of a small model's sync.
    A job never waits for a free thread (one is started when none is idle), so the pool
    grows to the number of operations in flight and no wait queues behind another."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[tuple], None], arg: tuple) -> None:
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


def _copy_batched(outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor]) -> None:
    """``outs[i].copy_(ins[i])`` for every i, in one ``torch._foreach_copy_`` per group of
    pairs with the same dtypes.

    On CUDA, a call whose pairs are all dense with equal strides runs as multi-tensor
    kernels (aten/src/ATen/native/cuda/ForeachBinaryOpList.cu
    ``foreach_tensor_copy_list_kernel_cuda_``: many tensors per launch); any other call
    (strided slices, CPU) runs torch's C++ loop of ``copy_`` (``..._kernel_slow_``), which
    spares the Python around each copy. So the dense pairs and the strided ones go in
    separate calls. A cast to the wire dtype (an fp32 model sent in bf16) gives ``copy_``'s
    bits (tests/test_transport.py on CPU, tests/gpu/test_gpu.py on CUDA)."""
    groups: dict[tuple[torch.dtype, torch.dtype, bool], tuple[list, list]] = {}
    for o, i in zip(outs, ins, strict=True):
        key = (o.dtype, i.dtype, o.is_contiguous() and i.is_contiguous())
        g = groups.get(key)
        if g is None:
            g = groups[key] = ([], [])
        g[0].append(o)
        g[1].append(i)
    with torch.no_grad():  # the sources may be parameters; the copies are not trained
        for o, i in groups.values():
            torch._foreach_copy_(o, i)


class _Link:
    """Mutable per-sync state of one network link, seen from one side."""

    def __init__(self, buckets: list[Bucket], buffers: list[torch.Tensor]) -> None:
        self.buckets = buckets
        self.buffers = buffers
        self.done: set[int] = set()  # bucket indices whose operation completed


class Transport:
    """Runs one ``SyncPlan`` again and again from one rank's point of view.

    Build one per rank and plan (``Transport(plan, rank, group=...)``), then call
    ``sync(sources, sink)`` on every rank of the group at each weight push. Ranks with no
    link in the plan may skip ``sync``.
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
        self.group = group
        self.bucket_bytes = max(plan.element_size, int(bucket_mb * 2**20))
        self.timeout_s = float(timeout_s)
        self.device = torch.device(device)
        self.window = window
        if dtype is None:
            if plan.element_size not in _DTYPES:
                raise ValueError(
                    f"plan.element_size={plan.element_size} has no default dtype; pass "
                    f"dtype= (one of {sorted(_DTYPES)} bytes: {list(_DTYPES.values())})."
                )
            dtype = _DTYPES[plan.element_size]
        if torch.empty((), dtype=dtype).element_size() != plan.element_size:
            raise ValueError(
                f"dtype {dtype} has {torch.empty((), dtype=dtype).element_size()} bytes per "
                f"element but plan.element_size={plan.element_size}: build the plan for the "
                "wire dtype you send."
            )
        self.dtype = dtype
        self.fingerprint = plan_fingerprint(plan)
        self.minimal_bytes = plan.minimal_bytes

        schedule = build_schedule(plan, self.bucket_bytes)
        self.schedule = schedule
        self.send_links = {k: v for k, v in schedule.items() if k[0] == rank}
        self.recv_links = {k: v for k, v in schedule.items() if k[1] == rank}
        self.local_copies = [c for c in plan.copies if c.src_rank == rank == c.dst_rank]
        self.dst_shapes = {d.name: tuple(d.shape) for d in plan.dst_tensors if d.rank == rank}
        self._local = [  # (copy, slice shape, what it feeds): colocated copies, per sync
            (
                c,
                _slice_shape(self.dst_shapes[c.dst_name], c.dim, c.length),
                f"{c.dst_name!r} on rank {rank}",
            )
            for c in self.local_copies
        ]
        self._local_bytes = sum(plan.copy_bytes(c) for c in self.local_copies)
        # How many pieces complete each destination shard on this rank (network entries +
        # local copies); a shard goes to the sink when its count reaches zero.
        pieces: dict[str, int] = dict.fromkeys(self.dst_shapes, 0)
        for buckets in self.recv_links.values():
            for b in buckets:
                for e in b.entries:
                    pieces[e.copy.dst_name] += 1
        for c in self.local_copies:
            pieces[c.dst_name] += 1
        self._pieces = pieces
        # Shards whose copies tile them exactly (one dim, disjoint, no gap) need no zero fill:
        # allocating them empty saves a memset of every byte a sync delivers.
        spans: dict[str, list[tuple[int, int, int]]] = {n: [] for n in self.dst_shapes}
        for c in plan.copies:
            if c.dst_rank == rank:
                spans[c.dst_name].append((c.dim, c.dst_start, c.length))
        self._tiled = {n: _tiles(sp, self.dst_shapes[n]) for n, sp in spans.items()}
        self.peers = sorted({s for s, _ in self.recv_links} | {d for _, d in self.send_links})
        self._buffers: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._views: dict[tuple[int, int], tuple] = {}  # _buffer_views' cache
        self._handshaken = False
        self._syncs = 0

    # -- metadata ---------------------------------------------------------------------

    def link_bytes(self) -> dict[tuple[int, int], int]:
        """Bytes per link this rank sends, including its in-process link."""
        out = {
            k: sum(b.numel for b in v) * self.plan.element_size for k, v in self.send_links.items()
        }
        local = sum(self.plan.copy_bytes(c) for c in self.local_copies)
        if local:
            out[(self.rank, self.rank)] = local
        return out

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

    def _header(self, peer: int) -> torch.Tensor:
        def counts(link: tuple[int, int]) -> tuple[int, int]:
            b = self.schedule.get(link, [])
            return len(b), sum(x.numel for x in b)

        fp = int.from_bytes(self.fingerprint[:16], "big")
        out_b, out_n = counts((self.rank, peer))
        in_b, in_n = counts((peer, self.rank))
        vals = [
            _HEADER_MAGIC,
            _HEADER_VERSION,
            self.rank,
            peer,
            self.plan.element_size,
            self.bucket_bytes,
            fp >> 66,
            (fp >> 4) & (2**62 - 1),
            out_b,
            out_n,
            in_b,
            in_n,
            len(self.plan.copies),
        ]
        return torch.tensor(vals, dtype=torch.int64, device=self.device)

    def handshake(self) -> float:
        """Exchange plan headers with every peer; raise if any peer's plan differs."""
        t0 = time.perf_counter()
        mine = {p: self._header(p) for p in self.peers}
        theirs = {
            p: torch.zeros(_HEADER_LEN, dtype=torch.int64, device=self.device) for p in self.peers
        }
        ops: list[tuple[str, int, object]] = []
        # Ordered by rank (NCCL: one in-order stream per pair): the lower rank sends first.
        for p in self.peers:
            for kind in ("send", "recv") if self.rank < p else ("recv", "send"):
                if kind == "send":
                    w = dist.isend(mine[p], dst=p, group=self.group, tag=_HANDSHAKE_TAG)
                else:
                    w = dist.irecv(theirs[p], src=p, group=self.group, tag=_HANDSHAKE_TAG)
                ops.append((kind, p, w))
        self._poll(
            ops,
            lambda kind, peer, *_: (
                f"the plan handshake with rank {peer} ({kind}) did not complete: rank {peer} "
                "is not running Transport.sync (dead, stuck, or not started), or its plan "
                f"has no link with rank {self.rank} (the two sides were built from "
                "different configs: compare trainer TP/PP, rollout TP and rank placement)"
            ),
            on_done=None,
        )
        for p in self.peers:
            self._check_header(p, mine[p].tolist(), theirs[p].tolist())
        self._handshaken = True
        return time.perf_counter() - t0

    def _check_header(self, peer: int, mine: list[int], theirs: list[int]) -> None:
        if theirs[0] != _HEADER_MAGIC or theirs[1] != _HEADER_VERSION:
            raise PlanMismatchError(
                f"rank {self.rank}: rank {peer} sent a plan header with magic/version "
                f"{theirs[:2]} (expected {[_HEADER_MAGIC, _HEADER_VERSION]}): it runs another "
                "megatron-grpo version or is sending something else on this process group."
            )
        problems = []
        if theirs[4] != mine[4]:
            problems.append(f"element size {theirs[4]} vs {mine[4]} bytes (wire dtype differs)")
        if theirs[5] != mine[5]:
            problems.append(f"bucket size {theirs[5]} vs {mine[5]} bytes (sync.bucket_mb differs)")
        if theirs[6:8] != mine[6:8]:
            problems.append(
                f"plan fingerprint differs ({theirs[12]} vs {mine[12]} copies in the plan)"
            )
        # The peer's outgoing link is my incoming link and vice versa.
        if (theirs[8], theirs[9]) != (mine[10], mine[11]):
            problems.append(
                f"link {peer}->{self.rank}: rank {peer} will send {theirs[8]} buckets / "
                f"{theirs[9]} elements, rank {self.rank} expects {mine[10]} / {mine[11]}"
            )
        if (theirs[10], theirs[11]) != (mine[8], mine[9]):
            problems.append(
                f"link {self.rank}->{peer}: rank {peer} expects {theirs[10]} buckets / "
                f"{theirs[11]} elements, rank {self.rank} will send {mine[8]} / {mine[9]}"
            )
        if problems:
            raise PlanMismatchError(
                f"rank {self.rank} and rank {peer} were built from different sync plans: "
                + "; ".join(problems)
                + ". Both sides must build the plan from the same model, trainer TP/PP, "
                "rollout TP, rank placement, wire dtype and sync.bucket_mb."
            )

    # -- the sync ---------------------------------------------------------------------

    def _poll(self, ops: list, describe: Callable[..., str], on_done) -> float:
        """Wait for every op in ``ops`` (``on_done`` may post more), never blocking a post;
        returns the seconds spent blocked on the network.

        ``ops`` holds tuples whose third item is a torch ``Work``. Gloo's point-to-point
        works do not implement ``is_completed`` (c10d ``ProcessGroupGloo::SendWork`` only
        overrides ``wait``), so each op is waited on by a daemon thread (``Work.wait``
        releases the GIL) that reports to a queue; the main thread stays free to post new
        operations while others are pending, which the windowed schedule needs (the threads
        are one pool for the process, ``_WAITERS``). Each thread waits with ``timeout=timeout_s``: under NCCL a plain ``wait()`` returns once
        the op is enqueued on the stream (and a later ``.tolist()`` would block without
        bound), while ``wait(timeout)`` blocks the thread until the op is done or raises;
        under gloo it raises on timeout too (tearing the connection down, as any failed
        sync leaves the group unusable). The main thread also gives up after ``timeout_s``
        without any completion. Daemon threads, so that a rank that gave up after a
        ``SyncError`` can still exit.
        """
        done_q: queue.Queue = queue.Queue()

        bound = timedelta(seconds=self.timeout_s)

        def waiter(op: tuple) -> None:
            try:
                op[2].wait(timeout=bound)  # NCCL: blocks until done (wait() only enqueues)
                done_q.put((op, None))
            except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
                done_q.put((op, exc))

        pending: dict[int, tuple] = {}
        waited = 0.0

        def watch(new_ops: list) -> None:
            for op in new_ops:
                pending[id(op)] = op
                _WAITERS.submit(waiter, op)

        watch(ops)
        ops.clear()
        while pending:
            t_wait = time.perf_counter()
            try:
                op, exc = done_q.get(timeout=self.timeout_s)
            except queue.Empty:
                desc = ", ".join(describe(*o) for o in list(pending.values())[:4])
                more = f" (+{len(pending) - 4} more)" if len(pending) > 4 else ""
                raise SyncError(
                    f"rank {self.rank}: weight sync made no progress for {self.timeout_s:.1f}s "
                    f"(sync.timeout_s): {desc}{more}. Check that the peer process is alive "
                    "and called sync with the same plan; the process group is now unusable "
                    "and must be destroyed."
                ) from None
            waited += time.perf_counter() - t_wait
            del pending[id(op)]
            if exc is not None:  # a dead peer, or the op's own timeout
                raise SyncError(
                    f"rank {self.rank}: {describe(*op)}; the operation failed or did not "
                    f"complete within {self.timeout_s:.1f}s (sync.timeout_s). The process "
                    f"group reported: {exc}"
                ) from exc
            if on_done is not None:
                on_done(op, ops)
                watch(ops)
                ops.clear()
        return waited

    def _source(
        self,
        sources: Mapping[str, torch.Tensor],
        name: str,
        dim: int,
        start: int,
        shape: tuple[int, ...],
        feeds: str,
    ) -> torch.Tensor:
        """Rows ``[start, start + shape[dim])`` of source ``name`` along ``dim``, checked."""
        t = sources.get(name)
        if t is None:
            names = sorted(sources)
            raise SyncError(
                f"rank {self.rank} has no source shard {name!r}, which the plan copies "
                f"to {feeds}; this rank's shards are "
                f"{names[:6]}{' ...' if len(names) > 6 else ''} ({len(names)}). Build the "
                "plan from the same model and parallel layout as the trainer's Policy."
            )
        if start == 0 and t.shape == shape:
            return t  # the whole shard: no view to make
        length = shape[dim]
        if dim >= t.dim() or start + length > t.shape[dim]:
            raise SyncError(
                f"rank {self.rank}: source shard {name!r} has shape {tuple(t.shape)}, "
                f"the plan reads rows [{start}, {start + length}) of dim {dim} "
                f"for {feeds}: the plan and the trainer disagree on this tensor's layout."
            )
        s = t.narrow(dim, start, length)
        if s.shape != shape:
            raise SyncError(
                f"rank {self.rank}: slice of {name!r} has shape {tuple(s.shape)} but "
                f"{feeds} expects {shape}: the plan and the "
                "trainer disagree on this tensor's shape."
            )
        return s

    def _buffer_views(self, bucket: Bucket, buf: torch.Tensor) -> tuple[list, list]:
        """``buf``'s views of ``bucket``'s pack runs and unpack runs, shaped like the slices;
        made once per (bucket, buffer) and reused by every sync (a link's bucket always
        lands in the same slot buffer)."""
        key = (id(bucket), id(buf))
        hit = self._views.get(key)
        if hit is not None and hit[0] is bucket and hit[1] is buf:
            return hit[2], hit[3]

        def views(runs: tuple[Run, ...]) -> list[torch.Tensor]:
            flat = buf[: bucket.numel].split_with_sizes([r.numel for r in runs])
            return [v.view(r.shape) for v, r in zip(flat, runs, strict=True)]

        packs, unpacks = views(bucket.pack_runs), views(bucket.unpack_runs)
        # The entry holds bucket and buffer, so neither id can be reused while it exists.
        self._views[key] = (bucket, buf, packs, unpacks)
        return packs, unpacks

    def _pack(
        self, sources: Mapping[str, torch.Tensor], bucket: Bucket, buf: torch.Tensor
    ) -> torch.Tensor:
        """Copy ``bucket``'s slices of ``sources`` into ``buf``; returns the bucket's part."""
        views, _ = self._buffer_views(bucket, buf)
        srcs = [
            self._source(sources, r.name, r.dim, r.start, r.shape, r.feeds)
            for r in bucket.pack_runs
        ]
        _copy_batched(views, srcs)
        return buf[: bucket.numel]

    def _unpack(
        self, bucket: Bucket, buf: torch.Tensor, dst: Callable[[str], torch.Tensor]
    ) -> None:
        """Copy a received ``bucket`` out of ``buf`` into the destination shards
        (``dst(name)``: this rank's shard ``name``, allocated on first touch)."""
        _, views = self._buffer_views(bucket, buf)
        outs = []
        for r in bucket.unpack_runs:
            t = dst(r.name)
            outs.append(
                t if r.start == 0 and t.shape == r.shape else t.narrow(r.dim, r.start, r.length)
            )
        _copy_batched(outs, views)

    def sync(
        self,
        sources: Mapping[str, torch.Tensor],
        sink: Sink | None = None,
        finish: Callable[[], float | None] | None = None,
    ) -> tuple[SyncStats, dict[str, torch.Tensor]]:
        """Run one sync from this rank. Collective over the ranks that share links.

        ``sources``: this rank's trainer shards by ``Copy.src_name`` (empty on a pure
        receiver). ``sink(name, tensor)``: called with each destination shard of this rank
        as soon as it is complete (vLLM layout, zero where no copy writes). ``finish()``:
        called once after the last shard; it may return the seconds it measured itself
        (the vLLM side's post-load processing), else its wall time counts.
        Returns this rank's stats and the destination shards it built (empty when a
        ``sink`` took them).
        """
        t_start = time.perf_counter()
        st = SyncStats(
            rank=self.rank,
            method="direct",
            sync_index=self._syncs,
            minimal_bytes=self.minimal_bytes,
        )
        self._syncs += 1
        if not self._handshaken and self.peers:
            st.handshake_s = self.handshake()

        es = self.plan.element_size
        remaining = dict(self._pieces)
        built: dict[str, torch.Tensor] = {}

        def dst(name: str) -> torch.Tensor:
            t = built.get(name)
            if t is None:  # allocated on first touch: shards handed off early can be freed
                alloc = torch.empty if self._tiled[name] else torch.zeros
                t = built[name] = alloc(self.dst_shapes[name], dtype=self.dtype, device=self.device)
            return t

        def piece_done(name: str, n: int = 1) -> None:
            remaining[name] -= n
            if remaining[name] == 0:
                st.dst_bytes += built[name].numel() * es
                if sink is not None:
                    # The sink owns the shard from here: dropping our reference lets a
                    # receiver that copies it free it before the sync ends.
                    t0 = time.perf_counter()
                    sink(name, built.pop(name))
                    st.load_s += time.perf_counter() - t0

        # Destination shards no copy writes (all padding) are complete from the start.
        for name, n in remaining.items():
            if n == 0:
                dst(name)
                remaining[name] = 1
                piece_done(name)

        send = {k: _Link(v, self._buffers_for(k)) for k, v in self.send_links.items()}
        recv = {k: _Link(v, self._buffers_for(k)) for k, v in self.recv_links.items()}
        ops: list[tuple] = []

        def post_recv(link: tuple[int, int], lk: _Link, index: int) -> None:
            b, slot = lk.buckets[index], index % len(lk.buffers)
            w = dist.irecv(lk.buffers[slot][: b.numel], src=link[0], group=self.group, tag=b.index)
            ops.append(("recv", link[0], w, b, slot, link))

        def post_send(link: tuple[int, int], lk: _Link, index: int) -> None:
            b, slot = lk.buckets[index], index % len(lk.buffers)
            t0 = time.perf_counter()
            flat = self._pack(sources, b, lk.buffers[slot])
            st.pack_s += time.perf_counter() - t0
            w = dist.isend(flat, dst=link[1], group=self.group, tag=b.index)
            ops.append(("send", link[1], w, b, slot, link))
            st.bytes_sent += b.numel * es
            st.buckets_sent += 1
            key = link_key(*link)
            st.bytes_per_link[key] = st.bytes_per_link.get(key, 0) + b.numel * es

        # Per peer, the canonical order both sides issue in (``pair_order``), and how far
        # this rank got; an op whose buffer slot is busy holds back the rest of its pair.
        order = {
            p: pair_order(
                self.rank,
                p,
                len(self.send_links.get((self.rank, p), ())),
                len(self.recv_links.get((p, self.rank), ())),
            )
            for p in self.peers
        }
        cursor = dict.fromkeys(self.peers, 0)

        def advance(peer: int) -> None:
            seq = order[peer]
            while cursor[peer] < len(seq):
                kind, index = seq[cursor[peer]]
                if kind == "send":
                    link, lk = (self.rank, peer), send[(self.rank, peer)]
                else:
                    link, lk = (peer, self.rank), recv[(peer, self.rank)]
                if index >= len(lk.buffers) and index - len(lk.buffers) not in lk.done:
                    return  # its slot still holds bucket index - window
                (post_send if kind == "send" else post_recv)(link, lk, index)
                cursor[peer] += 1

        for p in self.peers:
            advance(p)

        # Colocated copies run while the first buckets are on the wire.
        t0 = time.perf_counter()
        outs, ins = [], []
        for c, shape, feeds in self._local:
            ins.append(self._source(sources, c.src_name, c.dim, c.src_start, shape, feeds))
            t = dst(c.dst_name)
            outs.append(t if t.shape == shape else t.narrow(c.dim, c.dst_start, c.length))
        _copy_batched(outs, ins)
        del outs, ins
        if self.local_copies:
            st.bytes_local = self._local_bytes
            st.bytes_per_link[link_key(self.rank, self.rank)] = st.bytes_local
        st.unpack_s += time.perf_counter() - t0
        for c in self.local_copies:
            piece_done(c.dst_name)

        def on_done(op: tuple, pending: list) -> None:
            kind, peer, _w, b, slot, link = op
            if kind == "recv":
                lk = recv[link]
                buf = lk.buffers[slot]
                t0 = time.perf_counter()
                self._unpack(b, buf, dst)
                st.unpack_s += time.perf_counter() - t0
                st.bytes_received += b.numel * es
                st.buckets_received += 1
                for name, n in b.dst_counts:
                    piece_done(name, n)
            else:
                lk = send[link]
            lk.done.add(b.index)  # its buffer slot is free again
            advance(peer)

        def describe(kind: str, peer: int, _w, b: Bucket, _slot, link) -> str:
            what = "receive from" if kind == "recv" else "send to"
            return (
                f"{what} rank {peer} of bucket {b.index + 1}/{len(self.schedule[link])} of link "
                f"{link[0]}->{link[1]} ({b.numel * es} bytes, first tensor "
                f"{b.entries[0].copy.dst_name!r})"
            )

        st.transfer_s = self._poll(ops, describe, on_done)

        missing = [n for n, k in remaining.items() if k != 0]
        if missing:  # cannot happen with a consistent schedule; guard the invariant anyway
            raise SyncError(f"rank {self.rank}: destination shards left incomplete: {missing[:5]}")
        if finish is not None:
            t0 = time.perf_counter()
            reported = finish()
            st.finish_s = float(reported) if reported is not None else time.perf_counter() - t0
        st.total_s = time.perf_counter() - t_start
        st.peak_bucket_bytes = self.bucket_memory_bytes
        return st, built
