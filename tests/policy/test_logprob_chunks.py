"""Chunked vocab-parallel log-probs: identical results to one piece (bit for bit, values and
gradients, also split over a TP group of 2) and a peak of live tensor bytes bounded by the
chunk, measured by counting every storage aten allocates while the call runs."""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.policy.logprob import logprob_peak_bytes, vocab_parallel_logprob_entropy
from tests.dist_utils import run_distributed
from tests.helpers.numerics import PeakBytes

VOCAB, PADDED = 300, 320


def _run(logits, target, chunk, group=None, vocab_start=0):
    x = logits.detach().clone().requires_grad_(True)
    logp, ent = vocab_parallel_logprob_entropy(
        x, target, vocab_start=vocab_start, vocab_size=VOCAB, group=group, chunk_tokens=chunk
    )
    w = torch.linspace(-1, 1, logp.numel(), dtype=logp.dtype).view_as(logp)
    ((w * logp).sum() + (w.flip(0) * ent).sum()).backward()
    return logp.detach(), ent.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_are_bitwise_identical_to_one_piece(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(53, PADDED, generator=g)).to(dtype)
    target = torch.randint(0, VOCAB, (53,), generator=g)
    whole = _run(logits, target, chunk=10_000)
    for chunk in (1, 7, 53):
        for a, b in zip(whole, _run(logits, target, chunk)):
            assert torch.equal(a, b), chunk


def _tp2_worker(rank: int, world: int):
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(29, PADDED, generator=g)
    target = torch.randint(0, VOCAB, (29,), generator=g)
    half = PADDED // 2
    shard = logits[:, rank * half : (rank + 1) * half]
    out = {}
    for chunk in (4, 10_000):
        logp, ent, grad = _run(
            shard, target, chunk, group=dist.group.WORLD, vocab_start=rank * half
        )
        out[chunk] = (logp, ent, grad)
    return [torch.equal(a, b) for a, b in zip(out[4], out[10_000])]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_chunks_identical_over_a_tp_group():
    for res in run_distributed(_tp2_worker, 2):
        assert res == [True, True, True]


def test_peak_memory_is_bounded_by_the_chunk():
    n, vl, chunk = 1024, 1000, 64
    logits = torch.randn(n, vl)
    target = torch.randint(0, vl, (n,))
    full = n * vl * 4
    peaks = {}
    for c in (chunk, n):
        x = logits.clone().requires_grad_(True)
        with PeakBytes() as m:
            lp, en = vocab_parallel_logprob_entropy(
                x, target, vocab_start=0, vocab_size=vl, chunk_tokens=c
            )
            (lp.sum() + en.sum()).backward()
        peaks[c] = m.peak
    # Unavoidable: the logits' gradient and its accumulation into x.grad (2 full tensors),
    # and a few fp32 vectors per row (max, stats, logZ, E, outputs and their gradients).
    bound = 2 * full + logprob_peak_bytes(n, vl, chunk) + 32 * n * 4
    assert peaks[chunk] <= bound, (peaks, bound)
    assert peaks[n] > 2 * full + logprob_peak_bytes(n, vl, chunk)  # one piece: several full


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_temperature_inside_equals_dividing_the_logits(dtype):
    """``temperature=T`` divides each fp32 chunk: the same values and gradients, bit for bit,
    as dividing the whole logits first (what the policy did before), without that copy."""
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(41, PADDED, generator=g)).to(dtype)
    target = torch.randint(0, VOCAB, (41,), generator=g)
    w = torch.linspace(-1, 1, 41, dtype=dtype)
    out = {}
    for inside in (True, False):
        x = logits.clone().requires_grad_(True)
        logp, ent = vocab_parallel_logprob_entropy(
            x if inside else x / 0.7, target, vocab_start=0, vocab_size=VOCAB, chunk_tokens=8,
            temperature=0.7 if inside else 1.0,
        )  # fmt: skip
        ((w * logp).sum() + (w.flip(0) * ent).sum()).backward()
        out[inside] = (logp.detach(), ent.detach(), x.grad)
    for a, b in zip(out[True], out[False]):
        assert torch.equal(a, b)
    assert not torch.equal(out[True][0], _run(logits, target, chunk=8)[0])  # T did act
    with pytest.raises(ValueError, match="temperature=0"):
        vocab_parallel_logprob_entropy(
            logits, target, vocab_start=0, vocab_size=VOCAB, temperature=0
        )


def test_temperature_adds_no_copy_of_the_logits():
    n, vl, chunk = 1024, 1000, 64
    logits = torch.randn(n, vl)
    target = torch.randint(0, vl, (n,))
    peaks = {}
    for t in (1.0, 0.7):
        x = logits.clone().requires_grad_(True)
        with PeakBytes() as m:
            lp, en = vocab_parallel_logprob_entropy(
                x, target, vocab_start=0, vocab_size=vl, chunk_tokens=chunk, temperature=t
            )
            (lp.sum() + en.sum()).backward()
        peaks[t] = m.peak
    assert peaks[0.7] <= peaks[1.0] + 4 * chunk * vl * 4, peaks  # a chunk, not n x vl
