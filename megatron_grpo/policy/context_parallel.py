"""Context parallelism of a packed micro-batch: its tokens split over the CP ranks in the
load-balanced zigzag order per document, attention over the full causal context by an
all-gather of K/V, and per-token values gathered back in token order. Design and the reason
for all-gather over a ring: docs/context-parallel.md.

Every document of a pack is padded (``PackedRows.build(doc_multiple=2*cp)``) to a multiple
of 2*cp tokens and cut into 2*cp equal chunks; rank r holds chunks r and 2*cp-1-r of every
document (megatron-core's ``get_batch_on_this_cp_rank`` split, per document as TE's THD
path does), so each rank holds T/cp tokens and the same share of causal work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_grpo.policy.rope import apply_rope


@dataclass(frozen=True)
class ZigzagSplit:
    """Which tokens of a pack rank ``rank`` of ``cp`` holds (host values; tensors built by
    ``tensors``). ``bounds``: the pack's documents, each a multiple of 2*cp tokens."""

    cp: int
    rank: int
    bounds: tuple[int, ...]

    def __post_init__(self) -> None:
        lens = [b - a for a, b in zip(self.bounds, self.bounds[1:])]
        bad = [n for n in lens if n % (2 * self.cp)]
        if bad:
            raise ValueError(
                f"ZigzagSplit: document lengths {bad[:4]} are not multiples of 2*cp="
                f"{2 * self.cp}: build the pack with PackedRows.build(doc_multiple=2*cp)."
            )

    def rank_ranges(self, rank: int) -> list[tuple[int, int, int]]:
        """The pack's [start, end) ranges rank ``rank`` holds, in its local order, each with
        its document's start: for each document, chunk ``rank`` then chunk ``2*cp-1-rank``."""
        out = []
        for a, b in zip(self.bounds, self.bounds[1:]):
            c = (b - a) // (2 * self.cp)
            for j in (rank, 2 * self.cp - 1 - rank):
                out.append((a + j * c, a + (j + 1) * c, a))
        return out

    def chunks(self) -> tuple[tuple[int, int, int, int], ...]:
        """This rank's query chunks: (local start, local end, key start, key end) with keys
        in pack positions; query i of a chunk sees keys [key start, key end - len + i]
        (causal, aligned at the chunk's end: its document's start up to itself)."""
        out, at = [], 0
        for lo, hi, doc in self.rank_ranges(self.rank):
            out.append((at, at + hi - lo, doc, hi))
            at += hi - lo
        return tuple(out)

    def local_positions(self, rank: int | None = None) -> torch.Tensor:
        """long [T/cp]: the pack positions of rank ``rank``'s tokens (this rank's by
        default), in its local order."""
        r = self.rank if rank is None else rank
        return torch.cat([torch.arange(lo, hi) for lo, hi, _ in self.rank_ranges(r)])

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(``local`` [T/cp], ``stacked`` [T], ``order`` [T]): this rank's pack positions;
        every rank's, stacked in rank order (what an all-gather of local tensors holds); and
        the inverse, the stacked row of each pack position (``stacked[order] = arange``)."""
        stacked = torch.cat([self.local_positions(r) for r in range(self.cp)])
        order = torch.empty_like(stacked)
        order[stacked] = torch.arange(stacked.numel())
        return self.local_positions(), stacked, order


@dataclass(frozen=True)
class ContextShard:
    """What the core attention and the scoring of one CP rank need of a pack (on the
    device): ``ZigzagSplit``'s tensors and chunks, and the CP group."""

    cp: int
    group: Any
    chunks: tuple[tuple[int, int, int, int], ...]
    local: torch.Tensor
    """long [T/cp]: this rank's pack positions."""
    stacked: torch.Tensor
    """long [T]: every rank's pack positions in rank order."""
    order: torch.Tensor
    """long [T]: the stacked row of each pack position."""

    def gather(self, local: torch.Tensor, *, replicated_loss: bool) -> torch.Tensor:
        """[T/cp, ...] per rank -> [T, ...] in pack order on every rank (differentiable).
        The backward of ``replicated_loss=True`` keeps this rank's rows of the gradient
        (every rank computes the same loss of the gathered values: log-probs); of False,
        it sums the ranks' gradients first (each rank's queries read all the keys: K/V)."""
        out: torch.Tensor = _GatherTokens.apply(local, self, replicated_loss)  # type: ignore[no-untyped-call]
        return out


def _all_gather(local: torch.Tensor, cp: int, group: Any) -> torch.Tensor:
    out = local.new_empty((cp * local.shape[0], *local.shape[1:]))
    dist.all_gather_into_tensor(out, local.contiguous(), group=group)
    return out


class _GatherTokens(torch.autograd.Function):
    """All-gather of per-rank token rows into pack order; backward in ``ContextShard.gather``."""

    @staticmethod
    def forward(
        ctx: Any, local: torch.Tensor, shard: ContextShard, replicated_loss: bool
    ) -> torch.Tensor:
        ctx.shard, ctx.replicated_loss, ctx.n = shard, replicated_loss, local.shape[0]
        return _all_gather(local, shard.cp, shard.group)[shard.order]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        shard: ContextShard = ctx.shard
        rank = dist.get_rank(shard.group)
        stacked = grad[shard.stacked].contiguous()  # rank-ordered rows
        if ctx.replicated_loss:
            return stacked[rank * ctx.n : (rank + 1) * ctx.n].clone(), None, None
        # NCCL and gloo alike (gloo has it in the pinned torch; megatron's sequence parallelism
        # reduce-scatters over gloo on CPU too): the branch a GPU run takes, run in CI
        out = stacked.new_empty((ctx.n, *stacked.shape[1:]))
        dist.reduce_scatter_tensor(out, stacked, group=shard.group)
        return out, None, None


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    shard: ContextShard,
    scale: float,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """Causal attention of this CP rank's queries [T/cp, nq, hn] over their documents' full
    context: keys/values [T/cp, nkv, hn] rotated (``rope``: cos/sin of the local
    positions), gathered over the CP group into pack order (one all-gather of K and V
    together; the backward reduce-scatters dK/dV), then one masked SDPA per local chunk.
    Returns [T/cp, nq * hn]."""
    t = query.shape[0]
    if rope is not None:
        cos, sin = (x if x.dtype == query.dtype else x.to(query.dtype) for x in rope)
        query, key = apply_rope(query, cos, sin), apply_rope(key, cos, sin)
    nkv = key.shape[1]
    kv = shard.gather(torch.cat([key, value], dim=1), replicated_loss=False)
    key_all, value_all = kv[:, :nkv], kv[:, nkv:]
    gqa = query.shape[1] != nkv
    outs = []
    for lo, hi, k0, k1 in shard.chunks:
        n, span = hi - lo, k1 - k0
        # query i sees keys k0 .. k1 - n + i: causal aligned at the chunk's end
        keep = torch.arange(span, device=query.device) <= torch.arange(
            span - n, span, device=query.device
        ).unsqueeze(1)
        q = query[lo:hi].transpose(0, 1).unsqueeze(0)
        k, v = (x[k0:k1].transpose(0, 1).unsqueeze(0) for x in (key_all, value_all))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=keep, scale=scale, enable_gqa=gqa
        )
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs).reshape(t, -1)
