"""Per-token log-probabilities and entropies from logits sharded over the TP vocabulary.

The output layer of megatron's GPTModel (``parallel_output=True``) leaves each TP rank with
logits for its own slice ``[r*Vm/T, (r+1)*Vm/T)`` of the padded vocabulary. The full vocab
is never gathered: each token costs one MAX all-reduce (the softmax shift) and one SUM
all-reduce of three numbers per token (sum of exp, sum of exp*logit, target logit) over the
TP group. Columns at or past the real vocabulary size (megatron's padding rows) are
excluded from the softmax, so the result equals ``log_softmax`` over the HF vocabulary.

Why not megatron's ``tensor_parallel.vocab_parallel_cross_entropy``: it gives only the
log-prob, so entropy would need a second pass with its own all-reduces; it reads the TP
group from megatron's globals instead of an explicit group; and for fp32 logits it
subtracts the max *in place* on the caller's tensor (tensor_parallel/cross_entropy.py
``calculate_predicted_logits``), which would corrupt logits another consumer still needs.
The math here is the same (max shift, sum-exp, target-logit pick).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    """(logits [N, Vl] local shard, target [N]) -> (logp [N], entropy [N]), exact gradients.

    With z the logits, p = softmax(z), E = sum_i p_i z_i:
      logp = z_t - logZ,               d logp / dz_i = 1[i=t] - p_i
      H    = logZ - E,                 d H / dz_i    = -p_i (z_i - E)
    Both gradients are local to the shard once logZ and E are known, so backward needs no
    communication.
    """

    @staticmethod
    def forward(ctx, logits, target, vocab_start: int, vocab_size: int, group):
        # Half-precision logits are upcast; fp32/fp64 keep their precision.
        z = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
        n, vl = z.shape
        cols = torch.arange(vocab_start, vocab_start + vl, device=z.device)
        valid = cols < vocab_size  # megatron's vocab padding rows are not tokens
        z_valid = z.masked_fill(~valid, float("-inf"))
        zmax = z_valid.max(dim=-1).values
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(z_valid - zmax.unsqueeze(-1))  # 0 on padding columns
        z0 = z.masked_fill(~valid, 0.0)
        local_t = target - vocab_start
        in_shard = (local_t >= 0) & (local_t < vl)
        idx = local_t.clamp(0, vl - 1)
        rows = torch.arange(n, device=z.device)
        stats = torch.stack([e.sum(-1), (e * z0).sum(-1), torch.where(in_shard, z[rows, idx], 0.0)])
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        sum_exp, sum_ez, z_target = stats
        log_z = zmax + torch.log(sum_exp)
        mean_z = sum_ez / sum_exp
        logp = z_target - log_z
        entropy = log_z - mean_z
        ctx.save_for_backward(e, sum_exp, mean_z, z0, idx, in_shard)
        ctx.logits_dtype = logits.dtype
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        e, sum_exp, mean_z, z0, idx, in_shard = ctx.saved_tensors
        p = e / sum_exp.unsqueeze(-1)
        grad = torch.zeros_like(p)
        if g_logp is not None:
            grad -= g_logp.unsqueeze(-1) * p
            rows = torch.arange(p.shape[0], device=p.device)
            grad[rows, idx] += torch.where(in_shard, g_logp, 0.0)
        if g_entropy is not None:
            grad -= g_entropy.unsqueeze(-1) * p * (z0 - mean_z.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_logprob_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``target`` and entropy of the softmax, from a TP shard of the logits.

    logits: [..., Vl] this rank's vocabulary slice, global columns
        ``[vocab_start, vocab_start + Vl)``; any dtype (computed in fp32).
    target: [...] global token ids (< vocab_size).
    vocab_size: the real vocabulary; columns >= vocab_size are padding and get probability 0.
    group: the TP process group (None or size 1: the shard is the full vocabulary).
    Returns (logp [...], entropy [...]) in fp32 (fp64 for fp64 logits), identical on every rank of ``group``.
    """
    shape = target.shape
    logp, entropy = _VocabParallelLogprobEntropy.apply(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), vocab_start, vocab_size, group
    )
    return logp.view(shape), entropy.view(shape)


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position-aligned per-token log-probs and entropies of a causal LM.

    logits [B, L, Vl] (logits at position t predict token t+1), input_ids [B, L].
    Returns logp, entropy [B, L] with ``logp[b, t] = log p(input_ids[b, t] | input_ids[b, <t])``
    and ``entropy[b, t]`` the entropy of that same predictive distribution, for t >= 1;
    both are 0 at t = 0 (no prediction for the first token).
    """
    logp, entropy = vocab_parallel_logprob_entropy(
        logits[:, :-1],
        input_ids[:, 1:],
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        group=group,
    )
    pad = logp.new_zeros(logp.shape[0], 1)
    return torch.cat([pad, logp], dim=1), torch.cat([pad, entropy], dim=1)
