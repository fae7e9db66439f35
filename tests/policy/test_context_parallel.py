"""Context parallelism's math (``policy/context_parallel.py``), without a model.

- The zigzag split: rank r holds chunks r and 2*cp-1-r of every document, every token once,
  the same number of tokens and of causal (query, key) pairs on every rank; ``order``
  inverts the ranks' stacked positions.
- Spawned gloo ranks, fp32: at CP=2 and CP=4 the core attention of each rank's tokens
  (RoPE included), gathered back in pack order, equals the one-rank packed attention of the
  whole pack, and so do dq, dk, dv of the same loss (<= 1e-5), with documents that straddle
  the ranks' chunks and a filler document; gathered log-probs carry each rank's own rows of
  the gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_grpo.policy.attention import varlen_attention_cpu
from megatron_grpo.policy.context_parallel import (
    ContextShard,
    ZigzagSplit,
    context_parallel_attention,
)
from megatron_grpo.policy.micro_batches import PackedRows
from megatron_grpo.policy.rope import apply_rope
from tests.dist_utils import run_distributed

TOL = 1e-5


def test_zigzag_split_balances_tokens_and_causal_work():
    split = ZigzagSplit(cp=2, rank=0, bounds=(0, 8, 12))
    # document 0: chunks of 2 (0-2 2-4 4-6 6-8), document 1: chunks of 1
    assert split.local_positions(0).tolist() == [0, 1, 6, 7, 8, 11]
    assert split.local_positions(1).tolist() == [2, 3, 4, 5, 9, 10]
    assert split.chunks() == ((0, 2, 0, 2), (2, 4, 0, 8), (4, 5, 8, 9), (5, 6, 8, 12))
    for cp in (2, 4):
        bounds = (0, 16, 24, 56)
        locals_ = [ZigzagSplit(cp, r, bounds).local_positions() for r in range(cp)]
        assert sorted(torch.cat(locals_).tolist()) == list(range(56))
        # causal pairs a rank computes: each query sees its document's start up to itself
        work = []
        for r in range(cp):
            work.append(sum(hi - k0 for _, hi, k0, _ in _pairs(ZigzagSplit(cp, r, bounds))))
        assert len({x.numel() for x in locals_}) == 1 and len(set(work)) == 1
        _, stacked, order = ZigzagSplit(cp, 1, bounds).tensors()
        assert torch.equal(stacked[order], torch.arange(56))
    with pytest.raises(ValueError, match="multiples of 2\\*cp=4"):
        ZigzagSplit(cp=2, rank=0, bounds=(0, 6))


def _pairs(split: ZigzagSplit):
    """(query position, query position + 1, document start, _) for every query of a rank."""
    out = []
    for lo, hi, doc in split.rank_ranges(split.rank):
        out += [(p, p + 1, doc, None) for p in range(lo, hi)]
    return out


def test_pack_pads_each_document_to_the_split():
    ids = torch.arange(1, 13).view(2, 6)
    pack = PackedRows.build(ids, [5, 2], doc_multiple=4)
    assert pack.bounds == (0, 8, 12)
    assert pack.input_ids[0].tolist() == [1, 2, 3, 4, 5, 0, 0, 0, 7, 8, 0, 0]
    # positions run on through a document's padding; only real tokens are scored
    assert pack.positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert pack.src.tolist() == [1, 2, 3, 4, 9]
    # an empty pack (expert-parallel filler) still splits
    assert PackedRows.build(ids[:0], [], doc_multiple=8).bounds == (0, 8)


def _inputs(t: int, nq: int = 4, nkv: int = 2, hn: int = 8):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t, n, hn, generator=g) for n in (nq, nkv, nkv))
    w = torch.randn(t, nq * hn, generator=g)
    pos = torch.arange(t) % 7
    inv = 1.0 / (10000 ** (torch.arange(0, hn, 2).float() / hn))
    freqs = torch.outer(pos.float(), inv)
    emb = torch.cat((freqs, freqs), -1).unsqueeze(1)
    return q, k, v, w, (emb.cos(), emb.sin())


def _attention_worker(rank: int, world: int, bounds: tuple[int, ...]):
    dist.init_process_group("gloo")
    t = bounds[-1]
    q, k, v, w, (cos, sin) = _inputs(t)
    split = ZigzagSplit(world, rank, bounds)
    local, stacked, order = split.tensors()
    shard = ContextShard(world, dist.group.WORLD, split.chunks(), stacked, order)
    ql, kl, vl = (x[local].clone().requires_grad_(True) for x in (q, k, v))
    out = context_parallel_attention(ql, kl, vl, shard, 0.3, (cos[local], sin[local]))
    full = shard.gather(out, replicated_loss=True)
    (full * w).sum().backward()
    grads = [shard.gather(g, replicated_loss=True).detach() for g in (ql.grad, kl.grad, vl.grad)]
    dist.destroy_process_group()
    return full.detach(), *grads


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_attention_equals_one_rank(cp):
    # documents of 16, 8 and 24 tokens (multiples of 2*cp at cp=4), then a filler of 8
    bounds = (0, 16, 24, 48, 56)
    q, k, v, w, (cos, sin) = _inputs(bounds[-1])
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    qr, kr = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    ref = varlen_attention_cpu(qr, kr, v, list(bounds), 0.3).reshape(bounds[-1], -1)
    (ref * w).sum().backward()
    for out, dq, dk, dv in run_distributed(_attention_worker, cp, bounds):
        torch.testing.assert_close(out, ref.detach(), atol=TOL, rtol=0)
        for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
            torch.testing.assert_close(got, want, atol=TOL, rtol=0)
