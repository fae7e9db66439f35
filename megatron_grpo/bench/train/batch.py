"""``bench train``'s GRPO batch (the command: ``bench/train/run.py``): the seeded right-padded
batch both sides run, the loss inputs its first log-prob pass gives it, its padded
micro-batches, and the one-sequence batch of the longest-sequence search."""

from __future__ import annotations

from typing import TypeVar

import torch

from megatron_grpo.algorithms.aggregation import GRPOLoss, compute_global_normalizers, make_loss_fn
from megatron_grpo.algorithms.step_batch import AdvantagedBatch, LossBatch, Rows, extend
from megatron_grpo.config.schema import GRPOConfig, KLConfig

R = TypeVar("R", bound=Rows)

LOGP_NOISE = 0.05
"""Std of the noise that makes ``alpha_engine_logp`` differ from the trainer's log-probs."""


def _advantaged(ids: torch.Tensor, attn: torch.Tensor, resp: torch.Tensor,
                adv: torch.Tensor) -> AdvantagedBatch:  # fmt: skip
    """Rows with every response token in the loss and no engine log-probs yet."""
    return AdvantagedBatch(
        input_ids=ids,
        attention_mask=attn,
        response_mask=resp,
        alpha_engine_logp=torch.zeros_like(resp),
        truncated=torch.zeros(ids.shape[0], dtype=torch.bool),
        advantages=adv,
        loss_mask=resp.clone(),
    )


def make_batch(
    vocab_size: int, rows: int, prompt_len: int, min_len: int, max_len: int, seed: int
) -> AdvantagedBatch:
    """A right-padded GRPO batch on the CPU: ``input_ids``, ``attention_mask`` (1 on real
    tokens), ``loss_mask`` and ``response_mask`` (1 on response tokens), ``advantages``
    (whitened normal, one per row). Token ids avoid the three special ids of the tiny
    tokenizer."""
    g = torch.Generator().manual_seed(seed)
    lo = max(1, prompt_len - prompt_len // 8)
    prompts = torch.randint(lo, prompt_len + 1, (rows,), generator=g).tolist()
    responses = torch.randint(min_len, max_len + 1, (rows,), generator=g).tolist()
    length = max(p + r for p, r in zip(prompts, responses))
    ids = torch.zeros(rows, length, dtype=torch.long)
    attn = torch.zeros(rows, length)
    resp = torch.zeros(rows, length)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids[b, : p + r] = torch.randint(3, vocab_size, (p + r,), generator=g)
        attn[b, : p + r] = 1
        resp[b, p : p + r] = 1
    adv = torch.randn(rows, generator=g)
    adv = (adv - adv.mean()) / adv.std().clamp(min=1e-6) if rows > 1 else adv
    return _advantaged(ids, attn, resp, adv)


def add_loss_inputs(batch: AdvantagedBatch, logp: torch.Tensor, seed: int) -> LossBatch:
    """The batch with what the GRPO loss reads: ``pi_k_logp`` and ``pi_ref_logp`` (the
    log-prob pass's ``logp``), ``alpha_engine_logp`` (the same plus noise, on response
    tokens) and the global normalizers of a one-rank mini-batch."""
    g = torch.Generator().manual_seed(seed + 1)
    mask = batch.loss_mask
    noise = torch.randn(logp.shape, generator=g) * LOGP_NOISE
    return extend(
        LossBatch,
        batch,
        alpha_engine_logp=(logp + noise) * mask,
        pi_k_logp=logp * mask,
        pi_ref_logp=logp * mask,
        normalizers=compute_global_normalizers(mask),
    )


def grpo_loss_fn() -> GRPOLoss:
    """The clipped off-policy surrogate with a k3 KL term (beta 0.1, the paper's GSM8K
    setup) and token-mean aggregation, built once as the trainer builds it."""
    return make_loss_fn(GRPOConfig(kl=KLConfig(kl_coef=0.1)))


def micro_batches(batch: R, size: int) -> list[tuple[slice, int, R]]:
    """(rows, trimmed length, micro-batch) of ``size`` rows in order, each trimmed to its
    own longest sequence (the padded path of ``Policy``; right padding needs no mask)."""
    b, seq = batch.input_ids.shape
    assert batch.attention_mask is not None
    out = []
    for start in range(0, b, size):
        rows = slice(start, min(start + size, b))
        nz = batch.attention_mask[rows].nonzero()
        length = max(int(nz[:, 1].max()) + 1 if len(nz) else 1, 2)

        def cut(_: str, v: torch.Tensor, rows: slice = rows, length: int = length) -> torch.Tensor:
            t = v[rows]
            return t[:, :length].contiguous() if t.dim() >= 2 and t.shape[1] == seq else t

        out.append((rows, length, batch.map_rows(cut)))
    return out


def one_sequence(vocab_size: int, length: int, prompt_len: int, seed: int) -> AdvantagedBatch:
    """A batch of one sequence of exactly ``length`` tokens, its first
    ``min(prompt_len, length // 2)`` the prompt (what the length search trains)."""
    g = torch.Generator().manual_seed(seed)
    resp = torch.zeros(1, length)
    resp[:, min(prompt_len, length // 2) :] = 1
    ids = torch.randint(3, vocab_size, (1, length), generator=g)
    return _advantaged(ids, torch.ones(1, length), resp, torch.ones(1))
