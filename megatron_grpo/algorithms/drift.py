"""Drift of the trainer's policy from the served one, and the adaptive sync rule (issue 25).

vLLM serves the lagged policy alpha = pi_{k-lag}; the trainer holds pi_k. The policy
improvement bound of off-policy GRPO (Mroueh et al., arXiv 2505.22257, Theorem 1),

    J(pi) - J(pi_k) >= L_alpha(pi) - 2 (1 - sigma)/sigma TV(pi, alpha) - 2 TV(pi_k, alpha),

loosens with TV(pi_k, alpha), and Pinsker bounds that by sqrt(KL(alpha || pi_k) / 2). The
trainer has what estimates the KL on every step: its own log-probs of the sampled tokens
under pi_k and alpha's (vLLM's) log-probs of the same tokens, sampled from alpha. With the
per-token ratio ``rho = pi_k / alpha`` the k3 estimator ``(rho - 1) - log rho`` (Schulman,
"Approximating KL divergence") is unbiased for KL(alpha || pi_k) under tokens drawn from
alpha, never negative, and has low variance when the two policies are close; its
token-mean is the drift (per-token KL; a sequence of L tokens carries about L times it, by
the chain rule). docs/algorithms.md, "Adaptive sync", states the rule and its link to the
bound.

Shapes: ``logp_BT`` (pi_k, the trainer), ``alpha_logp_BT`` (alpha, vLLM) are ``[B, T]``
log-probs of the sampled tokens; ``mask_BT`` ``[B, T]`` is 1 on response tokens, 0
elsewhere (a weight: any non-negative value weighs its token).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_grpo.algorithms.losses import LOG_RATIO_CLAMP


def k3_drift_sums(logp_BT: Tensor, alpha_logp_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """``[2]`` float64: (sum over ``mask`` of the per-token k3 estimate of KL(alpha || pi),
    sum of ``mask``). Sums, not the mean, so data-parallel shards add up exactly (all-reduce
    both, then :func:`drift_from_sums`). The log-ratio is clamped to +-20, as every ratio of
    this package (``losses.LOG_RATIO_CLAMP``)."""
    if logp_BT.shape != alpha_logp_BT.shape or logp_BT.shape != mask_BT.shape:
        raise ValueError(
            f"k3_drift_sums: logp {tuple(logp_BT.shape)}, alpha_logp "
            f"{tuple(alpha_logp_BT.shape)} and mask {tuple(mask_BT.shape)} must be the same "
            "[B, T] shape (position-aligned log-probs of the sampled tokens)."
        )
    m = mask_BT.detach().double()
    d = (logp_BT.detach().double() - alpha_logp_BT.detach().double()) * (m != 0)
    d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    k3 = torch.expm1(d) - d  # (rho - 1) - log rho, with rho = exp(d)
    return torch.stack([(k3 * m).sum(), m.sum()])


def drift_from_sums(sums: Tensor) -> float:
    """Token-mean drift from :func:`k3_drift_sums`' (possibly all-reduced) sums; 0 when no
    token was counted."""
    total, count = sums.tolist()  # one read to the host, not two
    return total / count if count > 0 else 0.0


def adaptive_sync_due(
    drift: float, since_sync: int, max_drift: float, min_interval: int, max_interval: int
) -> bool:
    """The adaptive rule: sync after a step when ``since_sync`` (steps trained since the last
    sync, this one included) reached ``max_interval``, or reached ``min_interval`` and the
    step's measured ``drift`` exceeds ``max_drift``; never before ``min_interval``."""
    if since_sync < min_interval:
        return False
    return since_sync >= max_interval or drift > max_drift
