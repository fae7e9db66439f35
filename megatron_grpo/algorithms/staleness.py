"""Staleness and engine numerics, measured apart (``grpo.off_policy.score_alpha``; issue 33).

The rollout log-probs vLLM returns are alpha's on vLLM's kernels (``alpha_engine_logp``); with
``grpo.off_policy.score_alpha`` the trainer also scores the samples under alpha's weights on its own
kernels (``alpha_trainer_logp``). Per token, today's log-ratio log pi_k - log alpha_vLLM splits as

    numerics  = log alpha_trainer - log alpha_vLLM   (same weights, two engines)
    staleness = log pi_k - log alpha_trainer         (same engine, weights v steps apart)

and each part goes where it belongs: the off-policy clip, REC/GSPO and OPMD read the
staleness ratio (alpha_trainer in the place of alpha: algorithms/policy_loss.py
``Role.ALPHA_TRAINER``), ``grpo.off_policy.tis`` truncates or masks the numerics ratio only, and
``sync.mode=adaptive`` reads the staleness KL (docs/algorithms.md, "Staleness and numerics").

Shapes: ``logp_BT`` (pi, differentiable), ``pi_k_logp_BT`` (pi_k, before the step's update),
``alpha_trainer_logp_BT`` (alpha on the trainer), ``alpha_engine_logp_BT`` (alpha from vLLM) are ``[B, T]``
log-probs of the sampled tokens, position-aligned; ``mask_BT`` is 1 on response tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_grpo.algorithms.losses import LOG_RATIO_CLAMP, seq_is_ratio, token_is_ratio

RATIO_PARTS = ("numerics", "staleness")
"""The two parts, in the order :func:`decomposition_sums` returns them."""


def split_log_ratios(
    pi_k_logp_BT: Tensor, alpha_trainer_logp_BT: Tensor, alpha_engine_logp_BT: Tensor
) -> tuple[Tensor, Tensor]:
    """``(numerics, staleness)`` ``[B, T]``: ``alpha - rollout`` and ``pi - alpha``; their
    sum is ``pi - rollout``, the log of today's ratio pi_k / alpha_vLLM."""
    return alpha_trainer_logp_BT - alpha_engine_logp_BT, pi_k_logp_BT - alpha_trainer_logp_BT


def _k3(d_BT: Tensor) -> Tensor:
    """Per-token k3 ``(rho - 1) - log rho`` with ``log rho = d`` clamped to +-20."""
    d = d_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.expm1(d) - d


def tis_touched_BT(
    pi_k_logp_BT: Tensor,
    alpha_engine_logp_BT: Tensor,
    mask_BT: Tensor,
    token_level: bool,
    cap: float,
) -> Tensor:
    """Bool ``[B, T]``: the response tokens whose TIS/MIS weight differs from the ratio
    (``ratio > cap``: truncated by ``*_truncate``, dropped by ``*_mask``), the ratio being
    ``exp(old - rollout)`` per token or per sequence (losses.token_is_ratio / seq_is_ratio)."""
    ratio_fn = token_is_ratio if token_level else seq_is_ratio
    ratio = ratio_fn(pi_k_logp_BT.double(), alpha_engine_logp_BT.double(), mask_BT)
    return (ratio > cap) & (mask_BT != 0)


DECOMPOSITION_SUMS = (
    "numerics_sum", "staleness_sum", "numerics_kl_sum", "staleness_kl_sum", "tokens",
    "tis_tokens", "tis_seqs", "tis_mixed_tokens", "tis_mixed_seqs", "seqs",
)  # fmt: skip


def decomposition_sums(
    pi_k_logp_BT: Tensor,
    alpha_trainer_logp_BT: Tensor,
    alpha_engine_logp_BT: Tensor,
    mask_BT: Tensor,
    tis: tuple[bool, float] | None = None,
) -> tuple[Tensor, Tensor]:
    """``(sums [10], maxima [2])`` float64 over ``mask``: sums add over data-parallel shards
    (all-reduce SUM), maxima take the largest (all-reduce MAX); :func:`decomposition_metrics`
    turns them into the step's metrics. Sums are named by ``DECOMPOSITION_SUMS``: each part's
    log-ratio and k3 KL (numerics: KL(alpha_vLLM || alpha_trainer), staleness:
    KL(alpha || pi_k)), the token count, the tokens and sequences ``tis = (token_level, cap)``
    touches on the numerics ratio and on the mixed one (pi_k / alpha_vLLM, what TIS reads
    without ``grpo.off_policy.score_alpha``), and the sequence count. Maxima: each part's largest
    ``|log-ratio|``."""
    m = mask_BT != 0
    numerics, staleness = (
        x.detach().double() * m
        for x in split_log_ratios(pi_k_logp_BT, alpha_trainer_logp_BT, alpha_engine_logp_BT)
    )
    seq_has = m.any(dim=1)
    sums = [numerics.sum(), staleness.sum(), (_k3(numerics) * m).sum(),
            (_k3(staleness) * m).sum(), m.sum().double()]  # fmt: skip
    for old in (alpha_trainer_logp_BT, pi_k_logp_BT):
        if tis is None:
            sums += [numerics.new_zeros(())] * 2  # on the inputs' device, as every sum
            continue
        touched = tis_touched_BT(old.detach(), alpha_engine_logp_BT.detach(), mask_BT, *tis)
        sums += [touched.sum().double(), touched.any(dim=1).sum().double()]
    sums.append(seq_has.sum().double())
    maxima = torch.stack([numerics.abs().max(), staleness.abs().max()]) if m.numel() else (
        numerics.new_zeros(2))  # fmt: skip
    return torch.stack([s.reshape(()) for s in sums]).double(), maxima


def decomposition_metrics(sums: Tensor, maxima: Tensor, with_tis: bool) -> dict[str, float]:
    """The step's metrics from :func:`decomposition_sums`' (all-reduced) tensors: mean and
    largest |.| of each part's log-ratio, each part's KL (token mean), and with ``with_tis``
    the fraction of response tokens and of sequences the TIS/MIS rule touches, on the
    numerics ratio (``tis_tokens_frac``, ``tis_seqs_frac``) and on the mixed ratio
    (``tis_mixed_*``: what it would touch without the split)."""
    # one read to the host for all of them (bench ops --loop), not one per value
    values = torch.cat([sums.double(), maxima.double()]).tolist()
    s = dict(zip(DECOMPOSITION_SUMS, values[: len(sums)], strict=True))
    tokens, seqs = max(s["tokens"], 1.0), max(s["seqs"], 1.0)
    out = {}
    for i, part in enumerate(RATIO_PARTS):
        out[f"{part}_mean"] = s[f"{part}_sum"] / tokens
        out[f"{part}_max_abs"] = values[len(sums) + i]
        out[f"{part}_kl"] = s[f"{part}_kl_sum"] / tokens
    if with_tis:
        for name in ("tis", "tis_mixed"):
            out[f"{name}_tokens_frac"] = s[f"{name}_tokens"] / tokens
            out[f"{name}_seqs_frac"] = s[f"{name}_seqs"] / seqs
    return out
