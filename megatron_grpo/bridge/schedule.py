"""The transport's static schedule: which operations each rank runs, and in what order.

Built once per (plan, bucket size), purely from the plan, identically on the sending and the
receiving side of every link, so that only raw bytes travel on every sync: no names, no
shapes, no per-tensor messages (docs/bridge.md, "Transport").

- **Buckets.** For every network link (``src_rank -> dst_rank``) the plan's copies are laid
  out, in plan order, into flat buckets of at most ``bucket_bytes``; a copy larger than the
  room left is split by rows along its own dim (``build_schedule``).
- **Runs.** Each bucket's entries are also merged into runs (``Run``: neighbouring entries
  that are one row range of one tensor on that side: q/k/v of a group, gate+up, a whole
  shard), so that the executor moves a bucket in a few batched copies instead of one
  ``copy_`` per slice: on an H100 one ``copy_`` per slice held the pack at 78 GB/s against
  1,359 GB/s for a device copy of the same bytes (tests/gpu/test_gpu.py
  ``test_bridge_pack_unpack_bandwidth``, Qwen2.5-0.5B, 242 slices on one link).
- **Order.** NCCL runs the operations between two ranks on one stream in issue order
  (docs/launch.md, "NCCL rules"), so both ranks of a pair issue their operations to each
  other in one canonical order (``pair_order``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_grpo.bridge.plan import Copy, SyncPlan, row_elems


class SyncError(RuntimeError):
    """A weight sync could not complete (peer missing, timeout, wrong inputs)."""


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
            shape = slice_shape(prev.shape, c.dim, length)
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


Schedule = dict[tuple[int, int], list[Bucket]]
"""``(src_rank, dst_rank) -> buckets``, in the order both sides issue them."""


def _bucket(index: int, entries: Sequence[Entry], numel: int) -> Bucket:
    counts = Counter(e.copy.dst_name for e in entries)
    return Bucket(
        index, tuple(entries), numel, _runs(entries, "src"), _runs(entries, "dst"),
        tuple(counts.items()),
    )  # fmt: skip


def slice_shape(shape: tuple[int, ...], dim: int, length: int) -> tuple[int, ...]:
    """``shape`` with ``dim`` set to ``length``: the shape of ``length`` rows along ``dim``."""
    out = list(shape)
    out[dim] = length
    return tuple(out)


def build_schedule(plan: SyncPlan, bucket_bytes: int) -> Schedule:
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
    return {link: _link_buckets(copies, shapes, cap) for link, copies in sorted(per_link.items())}


def _link_buckets(copies: list[Copy], shapes: dict, cap: int) -> list[Bucket]:
    """One link's copies in order, split by rows into buckets of at most ``cap`` elements."""
    buckets: list[Bucket] = []
    entries: list[Entry] = []
    fill = 0
    for c in copies:
        shape = shapes[(c.dst_rank, c.dst_name)]
        row = row_elems(shape, c.dim)
        done = 0
        while done < c.length:
            room_rows = (cap - fill) // row if row else c.length
            if room_rows == 0:
                if entries:
                    buckets.append(_bucket(len(buckets), entries, fill))
                    entries, fill = [], 0
                    continue
                room_rows = 1  # a single row larger than a bucket: its own bucket
            n = min(room_rows, c.length - done)
            part = Copy(c.src_rank, c.src_name, c.dst_rank, c.dst_name, c.dim,
                        c.src_start + done, c.dst_start + done, n)  # fmt: skip
            entries.append(Entry(part, fill, n * row, slice_shape(shape, c.dim, n)))
            fill += n * row
            done += n
            if fill >= cap:
                buckets.append(_bucket(len(buckets), entries, fill))
                entries, fill = [], 0
    if entries:
        buckets.append(_bucket(len(buckets), entries, fill))
    return buckets


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
