"""Output layer + per-token log-prob + entropy in one autograd Function that never holds the
[tokens, vocab/tp] logits: rows are scored a chunk at a time from the final hidden states and
this rank's vocabulary shard of the output weight, and backward recomputes each chunk's
logits. Why and how it compares with the logits path: docs/scoring.md."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_grpo.policy.logprob import CHUNK_TOKENS

FUSED_TEMPS_PER_CHUNK = 4
"""fp32 [chunk, V_local] tensors alive at once, at most (backward is the larger): the chunk's
logits, p, the gradient chunk and one product of the entropy term (``_chunk_grad``; measured
by tests/policy/test_scoring.py)."""


def fused_peak_bytes(tokens: int, local_vocab: int, hidden: int, elem: int) -> int:
    """Upper bound of what one ``fused_logprob_entropy`` call adds on the last stage for
    ``tokens`` rows: the chunk's fp32 temporaries, the [tokens, hidden] copy of the hidden
    states in the training dtype (``elem`` bytes) and their gradient, and the weight gradient
    [V_local, hidden]: the Function's (accumulated in fp32 for a 16-bit weight) and autograd's
    copy into ``.grad`` (measured: tests/policy/test_scoring.py); used by ``plan``."""
    chunk = FUSED_TEMPS_PER_CHUNK * 4 * min(tokens, CHUNK_TOKENS) * local_vocab
    weight_grad = local_vocab * hidden * (2 * elem + (4 if elem < 4 else 0))
    return chunk + 2 * tokens * hidden * elem + weight_grad


def _real_columns(local_vocab: int, vocab_start: int, vocab_size: int) -> int:
    """Columns of this shard below the real vocabulary (megatron's padding rows follow)."""
    return max(0, min(local_vocab, vocab_size - vocab_start))


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
    """(h @ w.T) / T in fp32 (fp64 stays fp64): the output layer's matmul in its own dtype,
    as megatron's ``linear_with_grad_accumulation_and_async_allreduce`` does, then upcast."""
    z = torch.matmul(h, w.t())
    z = z if z.dtype in (torch.float32, torch.float64) else z.float()
    return z if temperature == 1.0 else z / temperature


def _pick(z: torch.Tensor, local_target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(z[row, target] or 0 where the target is in another shard, the clamped column)."""
    in_shard = (local_target >= 0) & (local_target < z.shape[1])
    idx = local_target.clamp(0, z.shape[1] - 1)
    rows = torch.arange(z.shape[0], device=z.device)
    return torch.where(in_shard, z[rows, idx], 0.0), in_shard


class _FusedLinearLogprobEntropy(torch.autograd.Function):
    """(hidden [N, h], weight [Vl, h], target [N]) -> (logp [N], entropy [N]) of
    softmax(hidden @ weight[:real].T / T), with the gradients of both.

    Same math as ``policy.logprob._VocabParallelLogprobEntropy`` (d logp/dz_i = 1[i=t] - p_i,
    dH/dz_i = -p_i (z_i - E)); the padding rows of the weight are sliced off, not masked.
    Forward computes each chunk's logits once: the softmax shift is this rank's row max, and
    under TP the sums are rescaled to the group's max (one MAX and one SUM all-reduce, as
    before). Backward gets g_logp, g_entropy from any loss, recomputes each chunk's logits,
    and returns the hidden states' gradient (partial over the vocabulary shard: the TP
    all-reduce is the caller's input region) and the weight's (through autograd's
    accumulation, so megatron DDP's grad hooks and the tied-embedding all-reduce see it).
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        vocab_start: int,
        vocab_size: int,
        group: dist.ProcessGroup | None,
        chunk: int,
        temperature: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        w = weight[: _real_columns(weight.shape[0], vocab_start, vocab_size)]
        fp = hidden.dtype if hidden.dtype in (torch.float32, torch.float64) else torch.float32
        zmax = torch.full((n,), float("-inf"), dtype=fp, device=hidden.device)
        stats = torch.zeros(3, n, dtype=fp, device=hidden.device)
        for a in range(0, n, chunk) if w.shape[0] else ():
            z = _chunk_logits(hidden[a : a + chunk], w, temperature)
            zmax[a : a + chunk] = m = z.max(dim=-1).values
            e = (z - m.unsqueeze(-1)).exp_()
            stats[0, a : a + chunk] = e.sum(-1)
            stats[1, a : a + chunk] = (e * z).sum(-1)
            stats[2, a : a + chunk] = _pick(z, target[a : a + chunk] - vocab_start)[0]
            del z, e
        if group is not None and dist.get_world_size(group) > 1:
            local_max = zmax.clone()
            dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
            stats[:2] *= torch.exp(local_max - zmax)  # each shard's sums at the global shift
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        sum_exp, sum_ez, z_target = stats
        log_z = zmax + torch.log(sum_exp)
        mean_z = sum_ez / sum_exp
        ctx.save_for_backward(hidden, weight, target, zmax, sum_exp, mean_z)
        ctx.args = (vocab_start, vocab_size, chunk, temperature)
        return z_target - log_z, log_z - mean_z

    @staticmethod
    def backward(
        ctx: Any, g_logp: torch.Tensor | None, g_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, target, zmax, sum_exp, mean_z = ctx.saved_tensors
        vocab_start, vocab_size, chunk, temperature = ctx.args
        real = _real_columns(weight.shape[0], vocab_start, vocab_size)
        w = weight[:real]
        need_h, need_w = ctx.needs_input_grad[:2]
        grad_h = torch.zeros_like(hidden) if need_h else None
        # a 16-bit weight's gradient sums its chunks in fp32 (megatron's main_grad is fp32)
        acc = torch.float32 if weight.dtype in (torch.bfloat16, torch.float16) else weight.dtype
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        for a in range(0, hidden.shape[0], chunk) if real else ():
            b = slice(a, a + chunk)
            grad = _chunk_grad(
                _chunk_logits(hidden[b], w, temperature), target[b] - vocab_start, zmax[b],
                sum_exp[b], mean_z[b], g_logp, g_entropy, b, temperature,
            ).to(hidden.dtype)  # fmt: skip
            if grad_h is not None:
                grad_h[b] = torch.matmul(grad, w)
            if grad_w is not None and acc == weight.dtype:
                grad_w[:real].addmm_(grad.t(), hidden[b])
            elif grad_w is not None:
                grad_w[:real] += torch.matmul(grad.t(), hidden[b])
            del grad
        if grad_w is not None and grad_w.dtype != weight.dtype:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None, None


def _chunk_grad(
    z: torch.Tensor,
    local_target: torch.Tensor,
    zmax: torch.Tensor,
    sum_exp: torch.Tensor,
    mean_z: torch.Tensor,
    g_logp: torch.Tensor | None,
    g_entropy: torch.Tensor | None,
    b: slice,
    temperature: float,
) -> torch.Tensor:
    """d(sum g_logp * logp + g_entropy * H) / dz of one chunk, fp32 [c, V_real], computed in
    place on the chunk's logits ``z`` (ours to overwrite) so that at most four [c, V_real]
    tensors exist at once: z, p, the gradient and one product."""
    p = (z - zmax.unsqueeze(-1)).exp_()
    p /= sum_exp.unsqueeze(-1)
    if g_logp is not None:
        grad = p * -g_logp[b].unsqueeze(-1)
        in_shard = (local_target >= 0) & (local_target < p.shape[1])
        rows = torch.arange(p.shape[0], device=p.device)
        grad[rows, local_target.clamp(0, p.shape[1] - 1)] += torch.where(in_shard, g_logp[b], 0.0)
    else:
        grad = torch.zeros_like(p)
    if g_entropy is not None:
        term = g_entropy[b].unsqueeze(-1) * p
        del p
        term *= z.sub_(mean_z.unsqueeze(-1))
        grad -= term
    if temperature != 1.0:  # z = hidden @ w.T / T
        grad /= temperature
    return grad


def fused_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``target`` and entropy of ``softmax(hidden @ weight.T / temperature)`` over
    the real vocabulary, without the logits.

    hidden: [..., h] final hidden states (after the output layer's input region: replicated
        over the TP group). weight: [Vl, h] this rank's rows ``[vocab_start, vocab_start + Vl)``
        of the output weight (or the tied embedding). target: [...] global token ids.
    Rows at or past ``vocab_size`` are padding and are sliced off. Returns (logp, entropy)
    [...] in fp32 (fp64 for fp64 inputs), identical on every rank of ``group``.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1.")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0: it divides the logits.")
    shape = target.shape
    if hidden.shape[:-1].numel() != target.numel():
        raise ValueError(
            f"hidden {tuple(hidden.shape)} has {hidden.shape[:-1].numel()} rows but target has "
            f"{target.numel()} ids: pass one target id per hidden row."
        )
    # torch's Function.apply is unannotated (torch/autograd/function.py).
    logp, entropy = _FusedLinearLogprobEntropy.apply(  # type: ignore[no-untyped-call]
        hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), vocab_start,
        vocab_size, group, chunk_tokens, float(temperature),
    )  # fmt: skip
    return logp.view(shape), entropy.view(shape)
