"""Per-token KL(pi || pi_ref) estimators (Schulman, "Approximating KL divergence", 2020).

With ``d = ref_logp - logp`` per sampled token (the sample comes from pi, or from alpha
close to it):

- k1: ``logp - ref_logp`` = ``-d`` (unbiased, high variance, can be negative);
- k2: ``0.5 * (logp - ref_logp)^2`` (biased, low variance; its gradient is that of the
  reverse KL's second-order expansion);
- k3: ``exp(d) - d - 1`` (unbiased, always >= 0; TRL's choice, used by off-policy GRPO).

KL goes either into the loss (``beta * kl_t`` per token, aggregated like the policy loss) or
into the reward (``r_i - beta * sum_t kl_t``, :func:`kl_penalized_rewards`), chosen by
``grpo.kl.kl_in_reward``. All inputs are ``[B, T]`` log-probs of the sampled tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from megatron_grpo.algorithms.losses import LOG_RATIO_CLAMP

KLEstimator = Callable[[Tensor, Tensor], Tensor]


def kl_k1(logp_BT: Tensor, ref_logp_BT: Tensor) -> Tensor:
    """``logp - ref_logp``, ``[B, T]``."""
    return logp_BT - ref_logp_BT


def kl_k2(logp_BT: Tensor, ref_logp_BT: Tensor) -> Tensor:
    """``0.5 * (logp - ref_logp)^2``, ``[B, T]``."""
    return 0.5 * (logp_BT - ref_logp_BT) ** 2


def kl_k3(logp_BT: Tensor, ref_logp_BT: Tensor) -> Tensor:
    """``exp(d) - d - 1`` with ``d = clamp(ref - logp, -20, 20)``, ``[B, T]``.

    The log-ratio is clamped before the exp like every ratio here (``losses.LOG_RATIO_CLAMP``,
    as verl's ``kl_penalty(..., "low_var_kl")``); verl also clamps the k3 VALUE to
    ``[-10, 10]``, which we do not (TRL clamps neither)."""
    d = (ref_logp_BT - logp_BT).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(d) - d - 1


KL_ESTIMATORS: dict[str, KLEstimator] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def get_kl_estimator(name: str) -> KLEstimator:
    """The estimator function for ``grpo.kl.kl_estimator`` (looked up once, at build time)."""
    try:
        return KL_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"grpo.kl.kl_estimator={name!r} is unknown: use one of {sorted(KL_ESTIMATORS)}."
        ) from None


def kl_penalized_rewards(
    rewards_B: Tensor,
    logp_BT: Tensor,
    ref_logp_BT: Tensor,
    mask_BT: Tensor,
    beta: float,
    estimator: KLEstimator,
) -> Tensor:
    """KL in the reward: ``r_i - beta * sum_t mask_t * kl_t``, ``[B]``.

    ``logp_BT`` are the sampling policy's log-probs (alpha's, from the rollout); the result
    feeds the group advantages, so the penalty is not differentiated.
    """
    kl = estimator(logp_BT.detach(), ref_logp_BT.detach()) * mask_BT.to(logp_BT.dtype)
    return rewards_B - beta * kl.sum(dim=1)
