"""Per-token log-probabilities and entropies from logits sharded over the TP vocabulary: the
``model.logprob_impl=logits`` path of ``policy.scoring`` (and ``bench train``'s HF side).

Each TP rank holds the logits of its slice of the padded vocabulary (megatron's
``parallel_output=True``); the vocabulary is never gathered: one MAX and one SUM all-reduce
of three numbers per token. Columns past the real vocabulary are excluded from the softmax.
Not megatron's ``vocab_parallel_cross_entropy``: it gives no entropy, reads the TP group
from globals and shifts fp32 logits in place. What this path holds per micro-batch and why
the fused path does not: docs/scoring.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

CHUNK_TOKENS = 1024
"""Tokens whose fp32 [tokens x vocab/tp] temporaries exist at once, forward and backward.

Peak extra memory of a call is about ``LOGPROB_TEMPS_PER_CHUNK * 4 * CHUNK_TOKENS * Vl`` bytes
(``logprob_peak_bytes``) plus the [N, Vl] logits gradient the caller's autograd needs anyway,
whatever the number of tokens N: 0.6 GiB per temporary at Qwen's 151,936-column vocabulary
(tp=1), instead of ~10 GB each for a 4 x 4096-token micro-batch when done in one piece."""

LOGPROB_TEMPS_PER_CHUNK = 6
"""fp32 [chunk, Vl] tensors alive at once, at most (backward is the larger): the upcast
logits, the zero-filled logits, p, the gradient chunk and two products of the entropy term
(measured by tests/policy/test_logprob_chunks.py)."""


def logprob_peak_bytes(tokens: int, local_vocab: int, chunk_tokens: int = CHUNK_TOKENS) -> int:
    """Upper bound of the fp32 temporaries one ``vocab_parallel_logprob_entropy`` call holds
    at once (forward or backward) for ``tokens`` rows of ``local_vocab`` columns; used by
    ``megatron-grpo plan`` (dry_run/memory.py)."""
    return LOGPROB_TEMPS_PER_CHUNK * 4 * min(tokens, chunk_tokens) * local_vocab


def _upcast(z_in: torch.Tensor, temperature: float) -> torch.Tensor:
    """A chunk of logits in fp32 (fp64 stays fp64), divided by the sampling temperature."""
    z = z_in if z_in.dtype in (torch.float32, torch.float64) else z_in.float()
    return z if temperature == 1.0 else z / temperature


def _chunk_stats(
    z_in: torch.Tensor,
    target: torch.Tensor,
    zmax: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum exp(z - zmax), sum exp(z - zmax) * z, z[target] or 0) of one chunk of rows, with
    z = logits / temperature."""
    z = _upcast(z_in, temperature)
    n, vl = z.shape
    valid = torch.arange(vocab_start, vocab_start + vl, device=z.device) < vocab_size
    e = torch.exp(z.masked_fill(~valid, float("-inf")) - zmax.unsqueeze(-1))  # 0 on padding
    z0 = z.masked_fill(~valid, 0.0)
    local_t = target - vocab_start
    in_shard = (local_t >= 0) & (local_t < vl)
    idx = local_t.clamp(0, vl - 1)
    z_t = torch.where(in_shard, z[torch.arange(n, device=z.device), idx], 0.0)
    return e, z0, idx, in_shard, z_t


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    """(logits [N, Vl] local shard, target [N]) -> (logp [N], entropy [N]), exact gradients.

    With z the logits, p = softmax(z), E = sum_i p_i z_i:
      logp = z_t - logZ,               d logp / dz_i = 1[i=t] - p_i
      H    = logZ - E,                 d H / dz_i    = -p_i (z_i - E)
    Both gradients are local to the shard once logZ and E are known, so backward needs no
    communication.

    Memory: rows are processed ``chunk`` at a time (every quantity is per row, so the result
    is the same, bit for bit, as one piece); backward keeps only the caller's logits (already
    alive) and three fp32 numbers per row, and recomputes exp chunk by chunk. Still one MAX
    and one SUM all-reduce per call.
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        vocab_start: int,
        vocab_size: int,
        group: dist.ProcessGroup | None,
        chunk: int,
        temperature: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, vl = logits.shape
        fp = logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32
        valid = torch.arange(vocab_start, vocab_start + vl, device=logits.device) < vocab_size
        zmax = torch.empty(n, dtype=fp, device=logits.device)
        for a in range(0, n, chunk):
            z = _upcast(logits[a : a + chunk], temperature)
            zmax[a : a + chunk] = z.masked_fill(~valid, float("-inf")).max(dim=-1).values
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        stats = torch.empty(3, n, dtype=fp, device=logits.device)
        for a in range(0, n, chunk):
            e, z0, _, _, z_t = _chunk_stats(
                logits[a : a + chunk], target[a : a + chunk], zmax[a : a + chunk],
                vocab_start, vocab_size, temperature,
            )  # fmt: skip
            stats[0, a : a + chunk] = e.sum(-1)
            stats[1, a : a + chunk] = (e * z0).sum(-1)
            stats[2, a : a + chunk] = z_t
            del e, z0
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        sum_exp, sum_ez, z_target = stats
        log_z = zmax + torch.log(sum_exp)
        mean_z = sum_ez / sum_exp
        logp = z_target - log_z
        entropy = log_z - mean_z
        ctx.save_for_backward(logits, target, zmax, sum_exp, mean_z)
        ctx.vocab = (vocab_start, vocab_size, chunk, temperature)
        return logp, entropy

    @staticmethod
    def backward(
        ctx: Any, g_logp: torch.Tensor | None, g_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        logits, target, zmax, sum_exp, mean_z = ctx.saved_tensors
        vocab_start, vocab_size, chunk, temperature = ctx.vocab
        grad_out = torch.empty_like(logits)
        for a in range(0, logits.shape[0], chunk):
            b = slice(a, a + chunk)
            e, z0, idx, in_shard, _ = _chunk_stats(
                logits[b], target[b], zmax[b], vocab_start, vocab_size, temperature
            )
            p = e / sum_exp[b].unsqueeze(-1)
            del e
            grad = torch.zeros_like(p)
            if g_logp is not None:
                grad -= g_logp[b].unsqueeze(-1) * p
                rows = torch.arange(p.shape[0], device=p.device)
                grad[rows, idx] += torch.where(in_shard, g_logp[b], 0.0)
            if g_entropy is not None:
                grad -= g_entropy[b].unsqueeze(-1) * p * (z0 - mean_z[b].unsqueeze(-1))
            if temperature != 1.0:  # z = logits / T
                grad = grad / temperature
            grad_out[b] = grad.to(logits.dtype)
        return grad_out, None, None, None, None, None, None


def vocab_parallel_logprob_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``target`` and entropy of ``softmax(logits / temperature)``, from a TP shard
    of the logits.

    logits: [..., Vl] this rank's vocabulary slice, global columns
        ``[vocab_start, vocab_start + Vl)``; any dtype (computed in fp32).
    target: [...] global token ids (< vocab_size).
    vocab_size: the real vocabulary; columns >= vocab_size are padding and get probability 0.
    group: the TP process group (None or size 1: the shard is the full vocabulary).
    chunk_tokens: rows whose fp32 temporaries exist at once (``CHUNK_TOKENS``; the result
        does not depend on it).
    temperature: divides each fp32 chunk (and the gradient), so no divided copy of the whole
        [..., Vl] logits is made (the caller's logits stay as they are).
    Returns (logp [...], entropy [...]) in fp32 (fp64 for fp64 logits), identical on every rank of ``group``.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1.")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0: it divides the logits.")
    shape = target.shape
    # torch's Function.apply is unannotated (torch/autograd/function.py).
    logp, entropy = _VocabParallelLogprobEntropy.apply(  # type: ignore[no-untyped-call]
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), vocab_start, vocab_size, group,
        chunk_tokens, float(temperature),
    )  # fmt: skip
    return logp.view(shape), entropy.view(shape)


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position-aligned per-token log-probs and entropies of a causal LM (of
    ``softmax(logits / temperature)``).

    logits [B, L, Vl] (logits at position t predict token t+1), input_ids [B, L].
    Returns logp, entropy [B, L] with ``logp[b, t] = log p(input_ids[b, t] | input_ids[b, <t])``
    and ``entropy[b, t]`` the entropy of that same predictive distribution, for t >= 1;
    both are 0 at t = 0 (no prediction for the first token).
    """
    # Every position is scored (the last one against a dummy target, then dropped) so that
    # ``logits`` enters as a view: slicing off the last position first would copy the whole
    # [B, L-1, Vl] tensor, which backward keeps (the logits are saved for the recompute).
    target = torch.cat([input_ids[:, 1:], input_ids.new_zeros(input_ids.shape[0], 1)], dim=1)
    logp, entropy = vocab_parallel_logprob_entropy(
        logits,
        target,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        group=group,
        temperature=temperature,
    )
    pad = logp.new_zeros(logp.shape[0], 1)
    return torch.cat([pad, logp[:, :-1]], dim=1), torch.cat([pad, entropy[:, :-1]], dim=1)
