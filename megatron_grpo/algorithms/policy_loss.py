"""The policy loss, composed once from ``GRPOConfig``: which surrogate of
:mod:`~megatron_grpo.algorithms.losses`, which TIS weight, which regularizer, and which
log-probs play which role (``build_policy_loss``'s docstring). ``grpo.score_alpha``'s split
loss (:mod:`~megatron_grpo.algorithms.staleness`) is built from the same parts."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import Tensor

from megatron_grpo.algorithms.losses import (
    Metrics,
    PolicyLossFn,
    asymre_term,
    gspo_loss,
    mask_weight,
    mismatch_tis_weight,
    off_policy_clip_loss,
    opmd_term,
    rec_loss,
    rec_mask_none,
    rec_mask_one_side,
    rec_mask_ring,
    rec_mask_two_side,
    rec_weight_is,
    rec_weight_none,
    rec_weight_tis,
    seq_is_ratio,
    token_is_ratio,
    truncate_weight,
)

TisFn = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Metrics]]
CoreFn = Callable[..., tuple[Tensor, Metrics]]  # (logp, adv, mask, rollout_logp, old_logp)


def tis_weight_fn(c, exact: bool) -> TisFn | None:
    """``grpo.tis``: the truncated (or masked) token/sequence IS weight ``pi_k/alpha``."""
    if c.tis == "none":
        return None
    if not exact:
        raise ValueError(
            f"grpo.tis={c.tis!r} needs grpo.ratio_mode=exact (the trainer's pi_k log-probs): "
            "set grpo.ratio_mode=exact or grpo.tis=none."
        )
    ratio_fn = token_is_ratio if c.tis.startswith("token") else seq_is_ratio
    cap_fn = partial(truncate_weight if c.tis.endswith("truncate") else mask_weight, cap=c.tis_cap)
    return partial(mismatch_tis_weight, ratio_fn=ratio_fn, cap_fn=cap_fn)


def _off_policy_clip_fn(c, exact: bool, with_tis: bool) -> CoreFn:
    eps = {"eps_low": c.clip_eps_low, "eps_high": c.clip_eps_high}
    clip = partial(off_policy_clip_loss, **eps, dual_clip_c=c.dual_clip_c)
    if with_tis:

        def core(logp, adv, mask, rollout_logp, old_logp):
            return clip(logp, old_logp, adv, mask)
    elif exact:

        def core(logp, adv, mask, rollout_logp, old_logp):
            return clip(logp, rollout_logp, adv, mask, old_logp_BT=old_logp)
    else:

        def core(logp, adv, mask, rollout_logp, old_logp):
            return clip(logp, rollout_logp, adv, mask)

    return core


def _rec_fn(c) -> CoreFn:
    eps_lo, eps_hi = c.clip_eps_low, c.clip_eps_high
    mask_fn = {
        "none": rec_mask_none,
        "one_side": partial(rec_mask_one_side, eps_low=eps_lo, eps_high=eps_hi),
        "two_side": partial(rec_mask_two_side, eps_low=eps_lo, eps_high=eps_hi),
        "ring": partial(
            rec_mask_ring,
            eps_low=eps_lo,
            eps_high=eps_hi,
            ring_eps_low=c.rec_ring_eps_low,
            ring_eps_high=c.rec_ring_eps_high,
        ),
    }[c.rec_clip]
    weight_fn = {
        "none": rec_weight_none,
        "is": rec_weight_is,
        "tis": partial(rec_weight_tis, eps_low=c.rec_ring_eps_low, eps_high=c.rec_ring_eps_high),
    }[c.rec_weight]
    return partial(rec_loss, clip_mask_fn=mask_fn, weight_fn=weight_fn)


def surrogate_fn(c, exact: bool, with_tis: bool) -> CoreFn:
    """``grpo.policy_loss``: ``(logp, adv, mask, rollout_logp, old_logp) -> (loss_BT,
    metrics)``; rec and gspo take ``pi_old`` = ``old_logp`` (exact) or ``rollout_logp``."""
    if c.policy_loss == "off_policy_clip":
        return _off_policy_clip_fn(c, exact, with_tis)
    if c.policy_loss == "rec":
        ratio_loss = _rec_fn(c)
    elif c.policy_loss == "gspo":
        ratio_loss = partial(gspo_loss, eps_low=c.clip_eps_low, eps_high=c.clip_eps_high)
    else:
        raise ValueError(f"grpo.policy_loss={c.policy_loss!r}: use off_policy_clip, rec or gspo.")

    def core(logp, adv, mask, rollout_logp, old_logp):
        return ratio_loss(logp, old_logp if exact else rollout_logp, adv, mask)

    return core


def regularizer_fn(c) -> Callable[[Tensor, Tensor], Tensor] | None:
    """``grpo.regularizer``: ``(logp, pi_old logp) -> per-token term``, or None."""
    if c.regularizer == "none" or c.regularizer_coef == 0:
        return None
    if c.regularizer == "asymre":
        return lambda logp, old: asymre_term(logp, c.regularizer_coef)
    if c.regularizer == "opmd":
        return lambda logp, old: opmd_term(logp, old, c.regularizer_coef)
    raise ValueError(f"grpo.regularizer={c.regularizer!r}: use none, asymre or opmd.")


def build_policy_loss(grpo_cfg) -> PolicyLossFn:
    """Compose the policy-loss closure from ``GRPOConfig`` once.

    Which log-probs play which role:

    - ``policy_loss=off_policy_clip``: ``ratio_mode=one`` uses ``r = pi/alpha`` (alpha from
      ``rollout_logp``) and ``r' = 1``; ``exact`` adds ``r' = pi_k/alpha`` from ``old_logp``.
      With ``tis != none`` the surrogate is PPO around pi_k (``r = pi/pi_k``, ``r' = 1``) times
      the TIS weight ``min(pi_k/alpha, C)``: untruncated, ``(pi_k/alpha) * f(pi/pi_k, 1, A)``
      equals ``f_eps(pi/alpha, r', A)`` with multiplicative instead of additive eps, so TIS
      is the truncated form of the exact off-policy objective (decoupled PPO).
    - ``rec`` / ``gspo``: ``rho = pi/pi_old`` with ``pi_old = old_logp`` (exact) or
      ``rollout_logp`` (one); the TIS weight, if any, multiplies the per-token loss.
    - regularizer OPMD pulls toward the same ``pi_old``; AsymRE needs none.

    The returned function is ``(logp_BT, adv, mask_BT, rollout_logp_BT, old_logp_BT) ->
    (loss_BT, metrics)``; ``old_logp_BT`` may be None only when ``ratio_mode=one``.
    """
    c = grpo_cfg
    exact = c.ratio_mode == "exact"
    tis_fn = tis_weight_fn(c, exact)
    core = surrogate_fn(c, exact, with_tis=tis_fn is not None)
    reg_fn = regularizer_fn(c)

    combined = compose_policy_loss(core, tis_fn, reg_fn, exact)

    def policy_loss(logp_BT, adv, mask_BT, rollout_logp_BT, old_logp_BT):
        # alpha is vLLM's rollout log-prob; TIS weighs pi_k against it
        return combined(
            logp_BT, adv, mask_BT, rollout_logp_BT, old_logp_BT, old_logp_BT, rollout_logp_BT
        )

    return policy_loss


def compose_policy_loss(core, tis_fn, reg_fn, exact: bool):
    """The surrogate ``core`` (ratios against ``alpha_BT``), times the TIS weight of
    ``tis_logp_BT`` against ``rollout_logp_BT`` when ``tis_fn`` is set, plus the regularizer
    toward pi_old (``old_logp_BT`` under ``ratio_mode=exact``, else alpha): the one
    composition behind ``build_policy_loss`` and ``staleness.build_split_policy_loss``."""

    def combined(logp_BT, adv, mask_BT, alpha_BT, old_logp_BT, tis_logp_BT, rollout_logp_BT):
        if exact and old_logp_BT is None:
            raise ValueError(
                "grpo.ratio_mode=exact needs the trainer's pi_k log-probs (mb['old_logp']); "
                "compute them before the SGD pass or set grpo.ratio_mode=one."
            )
        loss, metrics = core(logp_BT, adv, mask_BT, alpha_BT, old_logp_BT)
        if tis_fn is not None:
            w, tis_metrics = tis_fn(tis_logp_BT, rollout_logp_BT, mask_BT)
            loss = loss * w
            metrics.update(tis_metrics)
        if reg_fn is not None:
            loss = loss + reg_fn(logp_BT, old_logp_BT if exact else alpha_BT)
        return loss, metrics

    return combined
