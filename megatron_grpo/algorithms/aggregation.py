"""Loss aggregation with GLOBAL normalizers, and the trainer-facing ``loss_fn``.

``make_loss_fn`` returns ``loss_fn(logp, entropy, mb) -> (loss, metrics)``; the policy applies
the gradient of the SUM of its losses over the mini-batch's micro-batches and DP ranks, so
every loss is pre-divided by normalizers spanning the whole mini-batch
(:func:`compute_global_normalizers`, once per mini-batch). The keys read from ``mb``, the
``grpo.loss_agg`` modes and ``grpo.loss_normalizer``: docs/algorithms.md, "Loss and
aggregation: the trainer contract".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from megatron_grpo.algorithms.kl import get_kl_estimator
from megatron_grpo.algorithms.losses import entropy_bonus, masked_mean
from megatron_grpo.algorithms.policy_loss import build_policy_loss
from megatron_grpo.algorithms.staleness import build_split_policy_loss
from megatron_grpo.algorithms.step_batch import LossFn, StepBatch


# ------------------------------------------------------------------------ pure aggregators
def agg_token_mean(loss_BT: Tensor, mask_BT: Tensor, num_tokens: Tensor | float) -> Tensor:
    """``sum(loss * mask) / num_tokens`` (num_tokens global over the mini-batch)."""
    return (loss_BT * mask_BT.to(loss_BT.dtype)).sum() / num_tokens


def agg_seq_mean_token_mean(loss_BT: Tensor, mask_BT: Tensor, num_seqs: Tensor | float) -> Tensor:
    """``sum_i (sum_t loss*mask / |y_i|) / num_seqs``; a sequence with no tokens adds 0."""
    m = mask_BT.to(loss_BT.dtype)
    per_seq = (loss_BT * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)
    return per_seq.sum() / num_seqs


def agg_seq_mean_token_sum(loss_BT: Tensor, mask_BT: Tensor, num_seqs: Tensor | float) -> Tensor:
    """``sum(loss * mask) / num_seqs``."""
    return (loss_BT * mask_BT.to(loss_BT.dtype)).sum() / num_seqs


def agg_constant(
    loss_BT: Tensor, mask_BT: Tensor, num_rows: Tensor | float, constant: float
) -> Tensor:
    """Dr.GRPO: ``sum(loss * mask) / (num_rows * constant)``, ``num_rows`` the mini-batch's
    sequence count (masked ones included), so the normalizer does not move with the masks."""
    return (loss_BT * mask_BT.to(loss_BT.dtype)).sum() / (num_rows * constant)


AGGREGATORS: dict[str, tuple[Callable[..., Tensor], str]] = {
    "token_mean": (agg_token_mean, "global_num_tokens"),
    "seq_mean_token_mean": (agg_seq_mean_token_mean, "global_num_seqs"),
    "seq_mean_token_sum": (agg_seq_mean_token_sum, "global_num_seqs"),
    "constant": (agg_constant, "global_num_rows"),
}
"""``grpo.loss_agg`` -> (the aggregator, the ``mb`` normalizer it divides by)."""


def _aggregator(c, max_response_len: int | None) -> Callable[[Tensor, Tensor, StepBatch], Tensor]:
    """``(loss_BT, mask_BT, mb) -> loss`` for ``grpo.loss_agg``, its normalizer read from ``mb``."""
    if c.loss_agg not in AGGREGATORS:
        raise ValueError(
            f"grpo.loss_agg={c.loss_agg!r}: use token_mean, seq_mean_token_mean, "
            "seq_mean_token_sum or constant."
        )
    agg, key = AGGREGATORS[c.loss_agg]
    extra: tuple = ()
    if c.loss_agg == "constant":
        constant = c.loss_agg_constant or max_response_len
        if not constant:
            raise ValueError(
                "grpo.loss_agg=constant with grpo.loss_agg_constant=0 needs the maximum response "
                "length: pass make_loss_fn(grpo_cfg, max_response_len=rollout.max_new_tokens) "
                "or set grpo.loss_agg_constant."
            )
        extra = (constant,)

    def aggregate(loss: Tensor, mask: Tensor, mb: StepBatch) -> Tensor:
        return agg(loss, mask, _need(mb, key, f"grpo.loss_agg={c.loss_agg}"), *extra)

    return aggregate


# ------------------------------------------------------------------------ global normalizers
def local_loss_counts(loss_masks: Tensor | Sequence[Tensor]) -> Tensor:
    """This rank's raw ``[num_tokens, num_seqs, num_rows]`` (float64) over its micro-batches'
    masks.

    A sequence counts when it has at least one loss token; every row counts in ``num_rows``.
    Masks may differ in ``T``.
    """
    masks = [loss_masks] if isinstance(loss_masks, Tensor) else list(loss_masks)
    counts = torch.zeros(3, dtype=torch.float64, device=masks[0].device if masks else "cpu")
    for m in masks:
        mf = m.to(torch.float64)
        counts[0] += mf.sum()
        counts[1] += (mf.sum(dim=1) > 0).sum()
        counts[2] += mf.shape[0]
    return counts


def normalizers_from_counts(counts: Tensor) -> dict[str, Tensor]:
    """Summed ``[num_tokens, num_seqs, num_rows]`` -> the ``mb`` normalizer entries (each at
    least 1, so that an all-masked mini-batch gives loss 0 instead of NaN)."""
    c = counts.clamp(min=1).to(torch.float32)
    return {"global_num_tokens": c[0], "global_num_seqs": c[1], "global_num_rows": c[2]}


def normalizer_mask(mb: StepBatch, loss_normalizer: str) -> Tensor:
    """The mask the global normalizers count for ``grpo.loss_normalizer``: ``kept`` ->
    ``mb["loss_mask"]`` (after the advantage step's keep mask); ``all`` ->
    ``mb["response_mask"]`` (every response token, before it). See docs/algorithms.md."""
    if loss_normalizer == "kept":
        return mb["loss_mask"]
    if loss_normalizer == "all":
        return _need(mb, "response_mask", "grpo.loss_normalizer=all")
    raise ValueError(f"grpo.loss_normalizer={loss_normalizer!r}: use kept or all.")


def compute_global_normalizers(
    loss_masks: Tensor | Sequence[Tensor],
    group: torch.distributed.ProcessGroup | None = None,
) -> dict[str, Tensor]:
    """Normalizers of one mini-batch, summed over its micro-batches and the DP ``group``.

    Args:
        loss_masks: this rank's ``loss_mask`` of the whole mini-batch, ``[B, T]``, or its
            micro-batches' masks (their ``T`` may differ).
        group: the data-parallel process group to all-reduce over; None for one rank.
    Returns:
        ``{"global_num_tokens", "global_num_seqs", "global_num_rows"}`` float 0-dim tensors; put both into every
        micro-batch ``mb`` of this mini-batch. Every DP rank must call this (a collective).
    """
    counts = local_loss_counts(loss_masks)
    if group is not None and torch.distributed.is_initialized():
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.SUM, group=group)
    return normalizers_from_counts(counts)


def _need(mb: StepBatch, key: str, why: str) -> Tensor:
    try:
        return mb[key]
    except KeyError:
        raise KeyError(
            f"loss_fn needs mb[{key!r}] ({why}); the trainer must put it in every "
            f"micro-batch. Present keys: {sorted(mb)}."
        ) from None


# --------------------------------------------------------------------------------- loss_fn
def make_loss_fn(grpo_cfg, max_response_len: int | None = None) -> LossFn:
    """Build the per-micro-batch ``loss_fn(logp, entropy, mb) -> (loss, metrics)``.

    Chooses once: the policy loss (:func:`build_policy_loss`), KL-in-loss and its estimator,
    the entropy bonus and the aggregation mode. ``max_response_len`` (``rollout.max_new_tokens``)
    is the Dr.GRPO constant when ``grpo.loss_agg_constant == 0``.

    Returned metrics are detached 0-dim tensors, means over this micro-batch's loss tokens
    (``num_tokens`` is the local count, to weight them when averaging over micro-batches).
    """
    c = grpo_cfg
    split = c.score_alpha  # staleness and numerics apart (algorithms/staleness.py)
    policy_loss = build_split_policy_loss(c) if split else build_policy_loss(c)
    exact = c.ratio_mode == "exact"
    kl_in_loss = c.kl_coef > 0 and not c.kl_in_reward
    kl_est = get_kl_estimator(c.kl_estimator)
    beta, ent_coef = c.kl_coef, c.entropy_coef

    aggregate = _aggregator(c, max_response_len)

    def loss_fn(logp: Tensor, entropy: Tensor, mb: StepBatch) -> tuple[Tensor, dict[str, Tensor]]:
        mask = _need(mb, "loss_mask", "response tokens").to(logp.dtype)
        adv = _need(mb, "advantages", "per-sequence advantages")
        rollout_logp = _need(mb, "rollout_logp", "alpha's log-probs from the rollout")
        old_logp = _need(mb, "old_logp", "ratio_mode=exact") if exact else None
        alpha = (_need(mb, "alpha_logp", "grpo.score_alpha"),) if split else ()
        tok_loss, metrics = policy_loss(logp, adv, mask, rollout_logp, old_logp, *alpha)
        metrics["pg_loss"] = masked_mean(tok_loss, mask)
        if kl_in_loss:
            kl = kl_est(logp, _need(mb, "ref_logp", "kl_coef > 0 with the KL in the loss"))
            tok_loss = tok_loss + beta * kl
            metrics["kl_ref"] = masked_mean(kl, mask)
        if ent_coef != 0:
            tok_loss = tok_loss + entropy_bonus(entropy, ent_coef)
        metrics["entropy"] = masked_mean(entropy, mask)
        metrics["num_tokens"] = mask.detach().sum()
        loss = aggregate(tok_loss, mask, mb)
        return loss, metrics

    return loss_fn
