"""The static send plan of a weight sync: which trainer shard slices compose each vLLM shard.

Computed once per (model, trainer TP/PP/VPP/DP placement, rollout TP, engine placement)
purely from :mod:`megatron_grpo.layouts` -- no process group, no GPU. Every vLLM parameter
shard on every engine rank is described by its HF pieces; every trainer shard on every
(dp, pp, tp) rank likewise; a copy is an overlap of the two in HF coordinates.

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

from megatron_grpo.bridge.plan_types import Copy, DstTensor, SyncPlan, row_elems
from megatron_grpo.layouts import megatron as mg
from megatron_grpo.layouts import vllm as vl
from megatron_grpo.layouts.megatron import MegatronLayout, NormStyle
from megatron_grpo.layouts.pieces import ShardLayout
from megatron_grpo.models.spec import ModelSpec

RankOf = Callable[[int, int, int], int]
"""``(dp_rank, pp_rank, tp_rank) -> global rank``."""


def megatron_rank_order(tp: int, dp: int, pp: int) -> RankOf:
    """megatron-core's default rank order ``tp-cp-ep-dp-pp`` (parallel_state.py
    ``initialize_model_parallel(order=...)``, first = fastest varying), cp = ep = 1."""

    def rank_of(dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        return tp_rank + tp * (dp_rank + dp * pp_rank)

    return rank_of


@dataclass(frozen=True)
class TrainerPlacement:
    """Where the trainer's shards live."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    rank_of: RankOf | Mapping[tuple[int, int, int], int] | None = None
    """(dp_rank, pp_rank, tp_rank) -> global rank; None = megatron-core's default order."""
    norm_style: NormStyle = "local"
    """``local`` or ``te`` parameter names for the layer norms (see layouts.megatron)."""
    padded_vocab: int | None = None
    """The model's padded vocabulary; None = ``megatron_padded_vocab(V, tp)``."""

    def global_rank(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        if self.rank_of is None:
            return megatron_rank_order(self.tp, self.dp, self.pp)(dp_rank, pp_rank, tp_rank)
        if callable(self.rank_of):
            return self.rank_of(dp_rank, pp_rank, tp_rank)
        return self.rank_of[(dp_rank, pp_rank, tp_rank)]

    @property
    def layout(self) -> MegatronLayout:
        return MegatronLayout(self.tp, self.pp, self.vpp, self.padded_vocab, self.norm_style)

    def src_name(self, vp_stage: int, name: str) -> str:
        """Trainer-state key of a shard (plan_types.Copy.src_name): ``chunk{c}.`` when vpp > 1."""
        return f"chunk{vp_stage}.{name}" if self.vpp > 1 else name


@dataclass
class _Segment:
    """One HF range held by a trainer shard, with every rank that holds it."""

    hf_start: int
    length: int
    holders: list[tuple[int, str, int]] = field(default_factory=list)
    """(global rank, src_name, offset of hf_start inside the shard)."""


def _source_index(spec: ModelSpec, trainer: TrainerPlacement) -> dict[str, list[_Segment]]:
    ml = trainer.layout
    mg.validate(spec, ml)
    index: dict[tuple[str, int, int], _Segment] = {}
    for pp_rank in range(trainer.pp):
        for vp in range(trainer.vpp):
            for tp_rank in range(trainer.tp):
                for lay in mg.chunk_shards(spec, ml, pp_rank, vp, tp_rank):
                    name = trainer.src_name(vp, lay.name)
                    for off, piece in lay.offsets():
                        if piece.is_zero:
                            continue
                        key = (piece.src, piece.start, piece.length)
                        seg = index.setdefault(key, _Segment(piece.start, piece.length))
                        for dp_rank in range(trainer.dp):
                            rank = trainer.global_rank(dp_rank, pp_rank, tp_rank)
                            seg.holders.append((rank, name, off))
    by_hf: dict[str, list[_Segment]] = {}
    for (hf_name, _, _), seg in index.items():
        by_hf.setdefault(hf_name, []).append(seg)
    for segs in by_hf.values():
        segs.sort(key=lambda s: (s.hf_start, s.length))
    return by_hf


def build_plan(
    spec: ModelSpec,
    trainer: TrainerPlacement,
    rollout_tp: int,
    engine_ranks: Sequence[Sequence[int]],
    element_size: int = 4,
) -> SyncPlan:
    """The copies that build every vLLM shard on every engine rank from trainer shards.

    ``engine_ranks[e][r]`` is the global rank hosting TP rank r of engine e (equal to a
    trainer rank when colocated). ``element_size`` is the wire dtype's bytes per element.
    Vocabulary padding rows get no copy (they stay zero on the receiver).
    """
    vl.validate(spec, rollout_tp)
    for e, ranks in enumerate(engine_ranks):
        if len(ranks) != rollout_tp:
            raise ValueError(
                f"engine {e} lists {len(ranks)} ranks {list(ranks)} but rollout tp={rollout_tp}"
            )
    sources = _source_index(spec, trainer)
    load: dict[int, int] = {}
    plan = SyncPlan(element_size=element_size)
    for ranks in engine_ranks:
        for tp_rank, dst_rank in enumerate(ranks):
            for dst in vl.rank_shards(spec, rollout_tp, tp_rank):
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
        if piece.is_zero:
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
