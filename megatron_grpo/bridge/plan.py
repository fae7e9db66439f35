"""The static send plan of a weight sync: which trainer shard slices compose each vLLM shard.

Computed once per (model, trainer layout, rollout TP, engine placement) purely from
:mod:`megatron_grpo.layouts` -- no process group, no GPU. Every vLLM parameter shard on
every engine rank is described by its HF pieces; every trainer shard on every (dp, pp, tp)
rank likewise; a copy is an overlap of the two in HF coordinates. The transport executes
the plan (``bridge.transport``).

Every copy moves a contiguous range along ONE dimension: column-parallel tensors (QKV,
gate/up, vocabulary rows, biases) slice along dim 0, row-parallel ones (o_proj/linear_proj,
down_proj/linear_fc2) along dim 1, replicated ones (norms) copy whole (dim 0, full length).
Destination ranges that no copy covers are vLLM's vocabulary padding and stay zero.

Source choice (no rank is a funnel):

1. a trainer rank that *is* the destination rank (colocated placement: an in-process copy);
2. otherwise the candidate that has been asked to send the fewest bytes so far. Candidates
   are every DP replica of the shard, every TP rank for TP-replicated tensors (norms), and
   for tied embeddings both the first stage's embedding and the last stage's output-layer
   copy (PP > 1).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from megatron_grpo.layouts import megatron as mg
from megatron_grpo.layouts import vllm as vl
from megatron_grpo.layouts.megatron import MegatronLayout
from megatron_grpo.layouts.pieces import ShardLayout
from megatron_grpo.models.spec import ModelSpec

# ---------------------------------------------------------------------------- data model


def row_elems(shape: tuple[int, ...], dim: int) -> int:
    """Elements in one index of ``dim``: the product of every other dimension of ``shape``."""
    n = 1
    for i, s in enumerate(shape):
        if i != dim:
            n *= s
    return n


@dataclass(frozen=True)
class Copy:
    """``dst[dst_name].narrow(dim, dst_start, length) <- src[src_name].narrow(dim, src_start, length)``."""

    src_rank: int
    """Global rank of the trainer process that holds the source shard."""
    src_name: str
    """Key of the source shard in that rank's trainer state (Megatron name, local layer
    index, prefixed by the virtual-pipeline chunk as ``chunk{c}.`` when vpp is used)."""
    dst_rank: int
    """Global rank of the process hosting the destination vLLM TP rank."""
    dst_name: str
    """vLLM parameter name (global layer index), e.g. ``model.layers.3.self_attn.qkv_proj.weight``."""
    dim: int
    src_start: int
    dst_start: int
    length: int


@dataclass(frozen=True)
class DstTensor:
    """One vLLM parameter shard that a sync builds on one destination rank."""

    rank: int
    name: str
    shape: tuple[int, ...]


@dataclass
class SyncPlan:
    copies: list[Copy] = field(default_factory=list)
    dst_tensors: list[DstTensor] = field(default_factory=list)
    element_size: int = 4
    """Bytes per element on the wire (4 for fp32, 2 for bf16)."""

    @property
    def minimal_bytes(self) -> int:
        """Sum of every vLLM shard that must arrive; replicated shards count per receiving rank.

        Zero padding rows are excluded: they are filled on the receiver, never sent.
        """
        return sum(c.length * self._row_elems(c) for c in self.copies) * self.element_size

    def _row_elems(self, c: Copy) -> int:
        return row_elems(self._dst_shapes()[(c.dst_rank, c.dst_name)], c.dim)

    def _dst_shapes(self) -> dict[tuple[int, str], tuple[int, ...]]:
        cache = getattr(self, "_shape_cache", None)
        if cache is None or len(cache) != len(self.dst_tensors):
            cache = {(d.rank, d.name): d.shape for d in self.dst_tensors}
            self._shape_cache = cache
        return cache

    def copy_bytes(self, c: Copy) -> int:
        return c.length * self._row_elems(c) * self.element_size

    def bytes_per_link(self) -> dict[tuple[int, int], int]:
        """(src_rank, dst_rank) -> bytes; a link with src == dst is an in-process copy."""
        out: dict[tuple[int, int], int] = {}
        for c in self.copies:
            key = (c.src_rank, c.dst_rank)
            out[key] = out.get(key, 0) + self.copy_bytes(c)
        return out


# ---------------------------------------------------------------------------- building


RankOf = Callable[[int, int, int], int]
"""``(dp_rank, pp_rank, tp_rank) -> global rank``."""


def megatron_rank_order(tp: int, dp: int, pp: int) -> RankOf:
    """megatron-core's default rank order ``tp-cp-ep-dp-pp`` (parallel_state.py
    ``initialize_model_parallel(order=...)``, first = fastest varying), cp = ep = 1."""

    def rank_of(dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        return tp_rank + tp * (dp_rank + dp * pp_rank)

    return rank_of


def src_name(trainer: MegatronLayout, vp_stage: int, name: str) -> str:
    """Trainer-state key of a shard (``Copy.src_name``): ``chunk{c}.`` when vpp > 1."""
    return f"chunk{vp_stage}.{name}" if trainer.vpp > 1 else name


def rank_lookup(
    trainer: MegatronLayout, rank_of: RankOf | Mapping[tuple[int, int, int], int] | None = None
) -> RankOf:
    """``rank_of`` as a function; None = megatron-core's default order for ``trainer``."""
    if rank_of is None:
        return megatron_rank_order(trainer.tp, trainer.dp, trainer.pp)
    if callable(rank_of):
        return rank_of
    return lambda dp_rank, pp_rank, tp_rank: rank_of[(dp_rank, pp_rank, tp_rank)]


@dataclass
class _Segment:
    """One HF range held by a trainer shard, with every rank that holds it."""

    hf_start: int
    length: int
    holders: list[tuple[int, str, int]] = field(default_factory=list)
    """(global rank, src_name, offset of hf_start inside the shard)."""


def _source_index(
    spec: ModelSpec, trainer: MegatronLayout, rank_of: RankOf
) -> dict[str, list[_Segment]]:
    mg.validate(spec, trainer)
    index: dict[tuple[str, int, int], _Segment] = {}
    for pp_rank in range(trainer.pp):
        for vp in range(trainer.vpp):
            for tp_rank in range(trainer.tp):
                for ep_rank in range(trainer.ep):
                    _index_chunk(spec, trainer, rank_of, index, pp_rank, vp, tp_rank, ep_rank)
    by_hf: dict[str, list[_Segment]] = {}
    for (hf_name, _, _), seg in index.items():
        by_hf.setdefault(hf_name, []).append(seg)
    for segs in by_hf.values():
        segs.sort(key=lambda s: (s.hf_start, s.length))
    return by_hf


def _index_chunk(
    spec: ModelSpec, trainer: MegatronLayout, rank_of: RankOf,
    index: dict[tuple[str, int, int], _Segment], pp_rank: int, vp: int, tp_rank: int,
    ep_rank: int,
) -> None:  # fmt: skip
    """Add one (pp, vp, tp, ep) chunk's shards to ``index``. An expert shard is held only by
    the DP replicas of its EP rank: megatron carves EP out of DP, EP varying fastest
    (rank order tp-cp-ep-dp-pp), so DP rank d is EP rank ``d % ep``; every other shard is
    the same on all EP ranks and is indexed once (from EP rank 0) for every DP replica."""
    for lay in mg.chunk_shards(spec, trainer, pp_rank, vp, tp_rank, ep_rank):
        expert = mg.is_expert(lay.name)
        if ep_rank and not expert:
            continue
        name = src_name(trainer, vp, lay.name)
        for off, piece in lay.offsets():
            if piece.src is None:  # padding
                continue
            key = (piece.src, piece.start, piece.length)
            seg = index.setdefault(key, _Segment(piece.start, piece.length))
            for dp_rank in range(trainer.dp):
                if expert and dp_rank % trainer.ep != ep_rank:
                    continue
                seg.holders.append((rank_of(dp_rank, pp_rank, tp_rank), name, off))


def build_plan(
    spec: ModelSpec,
    trainer: MegatronLayout,
    rollout_tp: int,
    engine_ranks: Sequence[Sequence[int]],
    element_size: int = 4,
    rank_of: RankOf | Mapping[tuple[int, int, int], int] | None = None,
    rollout_ep: bool = False,
) -> SyncPlan:
    """The copies that build every vLLM shard on every engine rank from trainer shards.

    ``trainer``: how the trainer is split (tp, pp, vpp, dp, norm naming, padded
    vocabulary). ``engine_ranks[e][r]`` is the global rank hosting TP rank r of engine e
    (equal to a trainer rank when colocated). ``element_size`` is the wire dtype's bytes per
    element. ``rank_of``: (dp_rank, pp_rank, tp_rank) -> global rank of the trainer's
    shards, a function or a table; None = megatron-core's default order. ``rollout_ep``: the
    engines run vLLM's expert parallelism (each rank holds whole experts, only its own:
    ``layouts.vllm.rank_shards``); ``rollout.expert_parallel`` turns it on (docs/moe.md).
    Vocabulary padding rows get no copy (they stay zero on the receiver).
    """
    vl.validate(spec, rollout_tp, rollout_ep)
    for e, ranks in enumerate(engine_ranks):
        if len(ranks) != rollout_tp:
            raise ValueError(
                f"engine {e} lists {len(ranks)} ranks {list(ranks)} but rollout tp={rollout_tp}"
            )
    sources = _source_index(spec, trainer, rank_lookup(trainer, rank_of))
    load: dict[int, int] = {}
    plan = SyncPlan(element_size=element_size)
    for ranks in engine_ranks:
        for tp_rank, dst_rank in enumerate(ranks):
            for dst in vl.rank_shards(spec, rollout_tp, tp_rank, rollout_ep):
                plan.dst_tensors.append(DstTensor(dst_rank, dst.name, dst.shape))
                plan.copies.extend(_copies_for(dst, dst_rank, sources, load, element_size))
    return plan


def _copies_for(
    dst: ShardLayout,
    dst_rank: int,
    sources: dict[str, list[_Segment]],
    load: dict[int, int],
    element_size: int,
) -> list[Copy]:
    row_bytes = row_elems(dst.shape, dst.dim) * element_size
    out: list[Copy] = []
    for doff, piece in dst.offsets():
        if piece.src is None:  # padding
            continue
        a, b = piece.start, piece.start + piece.length
        segs = [
            s for s in sources.get(piece.src, ()) if s.hf_start < b and s.hf_start + s.length > a
        ]
        cuts = sorted(
            {a, b} | {min(max(x, a), b) for s in segs for x in (s.hf_start, s.hf_start + s.length)}
        )
        for x, y in zip(cuts, cuts[1:]):
            cands = [
                (rank, name, off + x - s.hf_start)
                for s in segs
                if s.hf_start <= x and y <= s.hf_start + s.length
                for rank, name, off in s.holders
            ]
            if not cands:
                raise AssertionError(
                    f"no trainer shard holds {piece.src}[{x}:{y}] needed by {dst.name} on rank "
                    f"{dst_rank}: the layouts are inconsistent"
                )
            local = [c for c in cands if c[0] == dst_rank]
            rank, name, src_start = min(
                local or cands, key=lambda c: (load.get(c[0], 0), c[0], c[1])
            )
            n = y - x
            load[rank] = load.get(rank, 0) + n * row_bytes
            c = Copy(rank, name, dst_rank, dst.name, dst.dim, src_start, doff + x - a, n)
            prev = out[-1] if out else None
            if (
                prev is not None
                and (prev.src_rank, prev.src_name) == (c.src_rank, c.src_name)
                and prev.src_start + prev.length == c.src_start
                and prev.dst_start + prev.length == c.dst_start
            ):
                out[-1] = Copy(
                    prev.src_rank, prev.src_name, prev.dst_rank, prev.dst_name, prev.dim,
                    prev.src_start, prev.dst_start, prev.length + n,
                )  # fmt: skip
            else:
                out.append(c)
    return out


@dataclass(frozen=True)
class PlanReport:
    """Byte accounting of one sync (each sync executes the whole plan once)."""

    bytes_per_sync: int
    in_process_bytes: int
    """Copies whose source and destination are the same process (colocated)."""
    cross_process_bytes: int
    bytes_per_link: dict[tuple[int, int], int]
    sent_per_rank: dict[int, int]
    received_per_rank: dict[int, int]
    num_copies: int
    num_dst_tensors: int

    @property
    def max_sent(self) -> int:
        """The busiest sender's bytes: the funnel measure (equal to bytes_per_sync when one
        rank sends everything)."""
        return max(self.sent_per_rank.values(), default=0)

    def lines(self) -> list[str]:
        mib = 1 << 20
        out = [
            f"bytes per sync: {self.bytes_per_sync / mib:.2f} MiB in {self.num_copies} copies "
            f"into {self.num_dst_tensors} vLLM shards",
            f"  in-process {self.in_process_bytes / mib:.2f} MiB, cross-process "
            f"{self.cross_process_bytes / mib:.2f} MiB, busiest sender {self.max_sent / mib:.2f} MiB",
        ]
        for (s, d), n in sorted(self.bytes_per_link.items()):
            out.append(f"  link {s} -> {d}: {n / mib:.2f} MiB{' (in-process)' if s == d else ''}")
        return out


def plan_report(plan: SyncPlan) -> PlanReport:
    """Bytes per link / per rank / per sync of ``plan``, for logs and the GPU-free ``plan``
    command."""
    links = plan.bytes_per_link()
    sent: dict[int, int] = {}
    recv: dict[int, int] = {}
    for (s, d), n in links.items():
        if s != d:
            sent[s] = sent.get(s, 0) + n
            recv[d] = recv.get(d, 0) + n
    same = sum(n for (s, d), n in links.items() if s == d)
    total = sum(links.values())
    return PlanReport(
        bytes_per_sync=total,
        in_process_bytes=same,
        cross_process_bytes=total - same,
        bytes_per_link=links,
        sent_per_rank=sent,
        received_per_rank=recv,
        num_copies=len(plan.copies),
        num_dst_tensors=len(plan.dst_tensors),
    )
