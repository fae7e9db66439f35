"""Per-token policy-loss terms: off-policy clipped surrogate, REC family, GSPO, TIS, regularizers.

Every function here is pure tensor math and returns an UNAGGREGATED per-token loss ``[B, T]``
(to be minimised) plus a dict of detached scalar metrics computed over ``mask_BT``. Turning
``[B, T]`` into one scalar is :mod:`megatron_grpo.algorithms.aggregation`'s job.

Shapes: ``logp_BT`` (current policy pi, differentiable) and the other ``*_logp_BT``, named
by the policy they are of (``pi_old``: the ratio's old policy, pi_k or alpha; ``pi_k``;
``alpha_engine``: alpha as the engine served it; ``trainer``: pi_k or alpha scored on the
trainer) are ``[B, T]`` log-probs of the sampled tokens; ``adv`` is ``[B]`` (broadcast over
tokens) or ``[B, T]``; ``mask_BT`` is 1 on response tokens, 0 elsewhere.

:func:`megatron_grpo.algorithms.policy_loss.build_policy_loss` picks the variant once from
``GRPOConfig`` and returns a ``PolicyLoss``; nothing dispatches on strings per call.

Sources: Mroueh et al. 2505.22257 eqs. (6)-(7) (``f_eps(r, r', A)``); Yao et al. 2509.24203
(REC masks and weights, AsymRE, OPMD); DAPO 2503.14476 (asymmetric eps); Ye et al. 1912.09729
(dual-clip); Zheng et al. 2507.18071 (GSPO); Yao et al. 2025 "Your efficient RL framework
secretly brings you off-policy RL training" (TIS, and its masked variant).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from megatron_grpo.algorithms.step_batch import Metrics

LOG_RATIO_CLAMP = 20.0
"""Every log-ratio is clamped to ``[-20, 20]`` before it is exponentiated (verl's
``compute_policy_loss`` clamps ``negative_approx_kl`` the same way): without it a log-ratio
of 25 with dual-clip off gives a per-token loss of ~7e10 and an fp32 overflow not far
beyond. Outside the band the ratio is constant, so such a token passes no gradient."""


def ratio_exp(log_ratio: Tensor) -> Tensor:
    """``exp(clamp(log_ratio, -20, 20))``: the one way a ratio is formed in this package."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


# ----------------------------------------------------------------------------- helpers
def _adv_BT(adv: Tensor, like_BT: Tensor) -> Tensor:
    """Advantages ``[B]`` -> ``[B, 1]`` (broadcasts over tokens); ``[B, T]`` passes through."""
    if adv.dim() == 1:
        return adv[:, None].to(like_BT.dtype)
    if adv.shape != like_BT.shape:
        raise ValueError(
            f"advantages shape {tuple(adv.shape)} is neither [B]={like_BT.shape[0]} nor "
            f"[B, T]={tuple(like_BT.shape)}: pass one advantage per sequence or per token."
        )
    return adv.to(like_BT.dtype)


@torch.no_grad()
def masked_mean(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Mean of ``x`` over ``mask`` (0 when the mask is empty), detached (computed without
    autograd, so no detach ops: it runs for every metric of every micro-batch)."""
    m = mask_BT.to(torch.float32)
    return (x_BT.float() * m).sum() / m.sum().clamp(min=1)


def _masked_extreme(x_BT: Tensor, mask_BT: Tensor, largest: bool) -> Tensor:
    x = x_BT.detach().float()
    # a Python scalar, not a CPU tensor: on a GPU a CPU tensor operand is copied every call
    v = x.masked_fill(~mask_BT.bool(), -torch.inf if largest else torch.inf)
    v = v.max() if largest else v.min()
    return torch.where(torch.isfinite(v), v, torch.zeros_like(v))


def ratio_metrics(ratio_BT: Tensor, mask_BT: Tensor) -> Metrics:
    return {
        "ratio_mean": masked_mean(ratio_BT, mask_BT),
        "ratio_min": _masked_extreme(ratio_BT, mask_BT, largest=False),
        "ratio_max": _masked_extreme(ratio_BT, mask_BT, largest=True),
    }


def approx_kl_k3(logp_BT: Tensor, pi_old_logp_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Detached k3 estimate of KL(pi_old || pi)-style drift, for logging only."""
    d = (pi_old_logp_BT - logp_BT).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return masked_mean(torch.exp(d) - d - 1, mask_BT)


# ------------------------------------------------------------- off-policy clipped surrogate
def off_policy_clip_loss(
    logp_BT: Tensor,
    base_logp_BT: Tensor,
    adv: Tensor,
    mask_BT: Tensor,
    eps_low: float,
    eps_high: float,
    pi_k_logp_BT: Tensor | None = None,
    dual_clip_c: float | None = None,
) -> tuple[Tensor, Metrics]:
    """``-f_eps(r, r', A)`` per token (off-policy GRPO eq. 6-7).

    ``r = exp(logp - base_logp)``: pi over alpha (the behaviour policy), or over pi_k in
    TIS's PPO-around-pi_k form (policy_loss.OffPolicyClip); ``r' = exp(pi_k_logp - base_logp)``
    (pi_k / alpha; exactly 1 when ``pi_k_logp_BT`` is None) and
    ``f = min(r*A, clip(r, max(r' - eps_low, 0), r' + eps_high) * A)``.
    With r' = 1 this is PPO/GRPO clipping, with ``eps_high > eps_low`` DAPO's clip-higher.
    Dual-clip (``c > 1``): for ``A < 0`` the objective is ``max(f, c*A)``, bounding the loss
    of a token whose ratio has grown far above 1.

    Returns ``loss_BT`` ``[B, T]`` and metrics ``clip_frac_low`` (A<0 tokens held at the lower
    bound), ``clip_frac_high`` (A>0 tokens held at the upper bound), ``dual_clip_frac``,
    ratio mean/min/max and ``approx_kl`` (k3 of pi vs the ratio's denominator).
    """
    a = _adv_BT(adv, logp_BT)
    log_r = (logp_BT - base_logp_BT.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    r = torch.exp(log_r)
    if pi_k_logp_BT is None:
        r_prime = torch.ones_like(r)
    else:
        r_prime = ratio_exp(pi_k_logp_BT.detach() - base_logp_BT.detach())
    low = (r_prime - eps_low).clamp(min=0.0)
    high = r_prime + eps_high
    surr_unclipped = r * a
    surr_clipped = torch.clamp(r, low, high) * a
    obj = torch.minimum(surr_unclipped, surr_clipped)
    metrics: Metrics = {}
    if dual_clip_c is not None:
        floor = dual_clip_c * a
        dual = (a < 0) & (obj < floor)
        obj = torch.where(a < 0, torch.maximum(obj, floor), obj)
        metrics["dual_clip_frac"] = masked_mean(dual.float(), mask_BT)
    rd = r.detach()
    metrics["clip_frac_low"] = masked_mean(((a < 0) & (rd < low)).float(), mask_BT)
    metrics["clip_frac_high"] = masked_mean(((a > 0) & (rd > high)).float(), mask_BT)
    metrics.update(ratio_metrics(r, mask_BT))
    metrics["approx_kl"] = masked_mean(torch.exp(-log_r.detach()) + log_r.detach() - 1, mask_BT)
    return -obj, metrics


# ------------------------------------------------------------------------------ REC family
def rec_mask_none(rho_BT: Tensor, adv_BT: Tensor) -> Tensor:
    """REC without clipping: every token kept."""
    return torch.ones_like(rho_BT)


def rec_mask_one_side(rho_BT: Tensor, adv_BT: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """``(A>=0 and rho<=1+eps_high) or (A<=0 and rho>=1-eps_low)``: PPO's min-clip gradient."""
    keep = ((adv_BT >= 0) & (rho_BT <= 1 + eps_high)) | ((adv_BT <= 0) & (rho_BT >= 1 - eps_low))
    return keep.to(rho_BT.dtype)


def rec_mask_two_side(rho_BT: Tensor, adv_BT: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """``1-eps_low <= rho <= 1+eps_high`` regardless of the advantage's sign."""
    return ((rho_BT >= 1 - eps_low) & (rho_BT <= 1 + eps_high)).to(rho_BT.dtype)


def rec_mask_ring(
    rho_BT: Tensor,
    adv_BT: Tensor,
    eps_low: float,
    eps_high: float,
    ring_eps_low: float,
    ring_eps_high: float,
) -> Tensor:
    """Two-side band, plus ``(A>=0 and rho<=1-ring_eps_low)`` or ``(A<=0 and rho>=1+ring_eps_high)``.

    The outer ring re-admits tokens far on the side where the update moves rho back toward 1.
    """
    inner = (rho_BT >= 1 - eps_low) & (rho_BT <= 1 + eps_high)
    outer = ((adv_BT >= 0) & (rho_BT <= 1 - ring_eps_low)) | (
        (adv_BT <= 0) & (rho_BT >= 1 + ring_eps_high)
    )
    return (inner | outer).to(rho_BT.dtype)


def rec_weight_none(rho_BT: Tensor) -> Tensor:
    """NoIS: ``w = 1``."""
    return torch.ones_like(rho_BT)


def rec_weight_is(rho_BT: Tensor) -> Tensor:
    """IS: ``w = rho``."""
    return rho_BT


def rec_weight_tis(rho_BT: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """REC's truncated IS: ``w = clamp(rho, 1 - eps'_low, 1 + eps'_high)`` (Yao et al.
    2509.24203; Trinity-RFT ``epsilon_low_prime`` / ``epsilon_high_prime``). Not the
    rollout-mismatch TIS :func:`mismatch_tis_weight`, which is ``min(pi_k/alpha, C)``."""
    return rho_BT.clamp(min=1.0 - eps_low, max=1.0 + eps_high)


def rec_loss(
    logp_BT: Tensor,
    pi_old_logp_BT: Tensor,
    adv: Tensor,
    mask_BT: Tensor,
    clip_mask_fn: Callable[[Tensor, Tensor], Tensor],
    weight_fn: Callable[[Tensor], Tensor],
) -> tuple[Tensor, Metrics]:
    """Group-relative REINFORCE (Yao et al.): ``loss_t = -w_t * A * logp_t * M_t``.

    ``rho_t = stopgrad(exp(logp - pi_old_logp))``; ``M_t = clip_mask_fn(rho, A)`` and
    ``w_t = weight_fn(rho)`` are chosen at build time (``rec_mask_*``, ``rec_weight_*``).
    Metric ``rec_masked_frac``: fraction of loss tokens with ``M_t = 0``.
    """
    a = _adv_BT(adv, logp_BT)
    rho = ratio_exp(logp_BT.detach() - pi_old_logp_BT.detach())
    m = clip_mask_fn(rho, a.expand_as(rho))
    w = weight_fn(rho)
    loss = -w * a * logp_BT * m
    metrics = {
        "rec_masked_frac": masked_mean(1.0 - m, mask_BT),
        "rec_weight_mean": masked_mean(w, mask_BT),
        **ratio_metrics(rho, mask_BT),
        "approx_kl": approx_kl_k3(logp_BT, pi_old_logp_BT, mask_BT),
    }
    return loss, metrics


# ------------------------------------------------------------------------------------ GSPO
def gspo_loss(
    logp_BT: Tensor,
    pi_old_logp_BT: Tensor,
    adv: Tensor,
    mask_BT: Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[Tensor, Metrics]:
    """GSPO (Zheng et al.): sequence ratio ``s = exp(mean_t (logp - pi_old_logp))`` clipped.

    Per token the value is ``-min(s*A, clip(s, 1-eps_low, 1+eps_high)*A)`` (the same for every
    token of a sequence), written GSPO-token style ``s_t = sg(s) * exp(logp_t - sg(logp_t))``
    so that ``d s_t / d logp_t = s``; averaging over a sequence's tokens
    (``loss_agg=seq_mean_token_mean``) gives exactly GSPO's ``d s / d logp_t = s / |y|``.
    ``adv`` must be per sequence ``[B]``. Paper eps: 3e-4 / 4e-4.
    """
    if adv.dim() != 1:
        raise ValueError(f"GSPO needs one advantage per sequence, [B]; got {tuple(adv.shape)}.")
    m = mask_BT.to(logp_BT.dtype)
    n = m.sum(dim=1, keepdim=True).clamp(min=1)
    log_s = ((logp_BT.detach() - pi_old_logp_BT.detach()) * m).sum(dim=1, keepdim=True) / n
    log_s = log_s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    s_tok = torch.exp(log_s + logp_BT - logp_BT.detach())  # value s, gradient s * dlogp_t
    a = _adv_BT(adv, logp_BT)
    obj = torch.minimum(s_tok * a, torch.clamp(s_tok, 1 - eps_low, 1 + eps_high) * a)
    s = torch.exp(log_s).expand_as(logp_BT)
    metrics = {
        "clip_frac_low": masked_mean(((a < 0) & (s < 1 - eps_low)).float(), mask_BT),
        "clip_frac_high": masked_mean(((a > 0) & (s > 1 + eps_high)).float(), mask_BT),
        **ratio_metrics(s, mask_BT),
        "approx_kl": approx_kl_k3(logp_BT, pi_old_logp_BT, mask_BT),
    }
    return -obj, metrics


# ------------------------------------------------- TIS: rollout-vs-trainer mismatch weights
def token_is_ratio(
    trainer_logp_BT: Tensor, alpha_engine_logp_BT: Tensor, mask_BT: Tensor
) -> Tensor:
    """Token ratio ``exp(logp_train_old - logp_rollout)``, ``[B, T]`` (1 off the mask)."""
    d = (trainer_logp_BT - alpha_engine_logp_BT).detach() * mask_BT.to(trainer_logp_BT.dtype)
    return ratio_exp(d)


def seq_is_ratio(trainer_logp_BT: Tensor, alpha_engine_logp_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Sequence ratio ``exp(sum_t (logp_train_old - logp_rollout))`` broadcast to ``[B, T]``."""
    d = (trainer_logp_BT - alpha_engine_logp_BT).detach() * mask_BT.to(trainer_logp_BT.dtype)
    return ratio_exp(d.sum(dim=1, keepdim=True)).expand_as(trainer_logp_BT)


def truncate_weight(ratio_BT: Tensor, cap: float) -> Tensor:
    """TIS: ``min(ratio, C)``."""
    return ratio_BT.clamp(max=cap)


def mask_weight(ratio_BT: Tensor, cap: float) -> Tensor:
    """Masked IS: ``ratio`` where ``ratio <= C``, else 0 (the token/sequence is dropped)."""
    return torch.where(ratio_BT <= cap, ratio_BT, torch.zeros_like(ratio_BT))


def mismatch_tis_weight(
    trainer_logp_BT: Tensor,
    alpha_engine_logp_BT: Tensor,
    mask_BT: Tensor,
    ratio_fn: Callable[[Tensor, Tensor, Tensor], Tensor],
    cap_fn: Callable[[Tensor], Tensor],
) -> tuple[Tensor, Metrics]:
    """Rollout-mismatch TIS (``grpo.off_policy.tis``): the detached weight ``[B, T]`` =
    ``cap_fn(ratio_fn(old, rollout, mask))``, e.g. ``min(exp(logp_old - logp_rollout), C)``.
    It corrects vLLM-vs-trainer numerics only where old is alpha on the trainer (v = 1, or
    grpo.off_policy.score_alpha: staleness.py); REC's ``rec_weight=tis`` is a clamp of
    ``pi/pi_old``."""
    ratio = ratio_fn(trainer_logp_BT, alpha_engine_logp_BT, mask_BT)
    w = cap_fn(ratio)
    return w, {
        "tis_weight_mean": masked_mean(w, mask_BT),
        "tis_frac_capped": masked_mean((w != ratio).float(), mask_BT),
        "tis_ratio_max": _masked_extreme(ratio, mask_BT, largest=True),
    }


# ---------------------------------------------------------------------------- regularizers
def asymre_term(logp_BT: Tensor, coef: float) -> Tensor:
    """AsymRE: ``-c * logp_t``, i.e. the advantages shifted by ``+c`` (a lowered baseline)."""
    return -coef * logp_BT


def opmd_term(logp_BT: Tensor, pi_old_logp_BT: Tensor, coef: float) -> Tensor:
    """OPMD: ``c * (logp_t - pi_old_logp_t)^2`` (a proximal pull toward the old policy)."""
    return coef * (logp_BT - pi_old_logp_BT.detach()) ** 2


def entropy_bonus(entropy_BT: Tensor, coef: float) -> Tensor:
    """``-coef * H_t``: minimising it raises the entropy."""
    return -coef * entropy_BT
