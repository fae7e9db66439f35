"""Loss aggregation with GLOBAL normalizers, and the trainer-facing ``loss_fn``.

``make_loss_fn`` returns ``GRPOLoss``, ``loss_fn(logp, entropy, mb) -> (loss, metrics)`` with
``needs``, the log-probs its terms read by role (the trainer scores those); the policy applies
the gradient of the SUM of its losses over the mini-batch's micro-batches and DP ranks, so
every loss is pre-divided by normalizers spanning the whole mini-batch
(:func:`compute_global_normalizers`, once per mini-batch). The keys read from ``mb``, the
``grpo.loss.loss_agg`` modes and ``grpo.loss.loss_normalizer``: docs/algorithms.md, "Loss and
aggregation: the trainer contract".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_grpo.algorithms.kl import get_kl_estimator
from megatron_grpo.algorithms.losses import entropy_bonus, masked_mean
from megatron_grpo.algorithms.policy_loss import PolicyLoss, Role, RoleLogprobs, build_policy_loss
from megatron_grpo.algorithms.step_batch import AdvantagedBatch, LossBatch, Metrics, Normalizers
from megatron_grpo.config.schema import GRPOConfig


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
    "token_mean": (agg_token_mean, "num_tokens"),
    "seq_mean_token_mean": (agg_seq_mean_token_mean, "num_seqs"),
    "seq_mean_token_sum": (agg_seq_mean_token_sum, "num_seqs"),
    "constant": (agg_constant, "num_rows"),
}
"""``grpo.loss.loss_agg`` -> (the aggregator, the ``Normalizers`` field it divides by)."""


def _aggregator(
    c: GRPOConfig, max_response_len: int | None
) -> Callable[[Tensor, Tensor, Normalizers], Tensor]:
    """``(loss_BT, mask_BT, normalizers) -> loss`` for ``grpo.loss.loss_agg``."""
    if c.loss.loss_agg not in AGGREGATORS:
        raise ValueError(
            f"grpo.loss.loss_agg={c.loss.loss_agg!r}: use token_mean, seq_mean_token_mean, "
            "seq_mean_token_sum or constant."
        )
    agg, key = AGGREGATORS[c.loss.loss_agg]
    extra: tuple[float, ...] = ()
    if c.loss.loss_agg == "constant":
        constant = c.loss.loss_agg_constant or max_response_len
        if not constant:
            raise ValueError(
                "grpo.loss.loss_agg=constant with grpo.loss.loss_agg_constant=0 needs the maximum "
                "response length: pass make_loss_fn(grpo_cfg, max_response_len=rollout.max_new_tokens) "
                "or set grpo.loss.loss_agg_constant."
            )
        extra = (constant,)

    def aggregate(loss: Tensor, mask: Tensor, normalizers: Normalizers) -> Tensor:
        return agg(loss, mask, getattr(normalizers, key), *extra)

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


def normalizers_from_counts(counts: Tensor) -> Normalizers:
    """Summed ``[num_tokens, num_seqs, num_rows]`` -> ``Normalizers`` (each at least 1, so
    that an all-masked mini-batch gives loss 0 instead of NaN)."""
    c = counts.clamp(min=1).to(torch.float32)
    return Normalizers(num_tokens=c[0], num_seqs=c[1], num_rows=c[2])


def normalizer_mask(mb: AdvantagedBatch, loss_normalizer: str) -> Tensor:
    """The mask the global normalizers count for ``grpo.loss.loss_normalizer``: ``kept`` ->
    ``mb.loss_mask`` (after the advantage step's keep mask); ``all`` -> ``mb.response_mask``
    (every response token, before it). See docs/algorithms.md."""
    if loss_normalizer == "kept":
        return mb.loss_mask
    if loss_normalizer == "all":
        return mb.response_mask
    raise ValueError(f"grpo.loss.loss_normalizer={loss_normalizer!r}: use kept or all.")


def compute_global_normalizers(
    loss_masks: Tensor | Sequence[Tensor],
    group: torch.distributed.ProcessGroup | None = None,
) -> Normalizers:
    """Normalizers of one mini-batch, summed over its micro-batches and the DP ``group``.

    Args:
        loss_masks: this rank's ``loss_mask`` of the whole mini-batch, ``[B, T]``, or its
            micro-batches' masks (their ``T`` may differ).
        group: the data-parallel process group to all-reduce over; None for one rank.
    Returns:
        ``Normalizers`` of float 0-dim tensors, for the mini-batch's ``LossBatch``. Every DP
        rank must call this (a collective).
    """
    counts = local_loss_counts(loss_masks)
    if group is not None and torch.distributed.is_initialized():
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.SUM, group=group)
    return normalizers_from_counts(counts)


# --------------------------------------------------------------------------------- loss_fn
@dataclass(frozen=True)
class GRPOLoss:
    """The per-micro-batch ``loss_fn(logp, entropy, mb) -> (loss, metrics)``: the policy loss,
    the KL to pi_ref in the loss, the entropy bonus, aggregated by the global normalizers.
    ``needs``: the log-probs its terms read by role; the trainer scores exactly those
    (trainer/logprobs.py). Metrics are detached 0-dim tensors, means over this micro-batch's
    loss tokens (``num_tokens`` is the local count, to weight them over micro-batches)."""

    policy_loss: PolicyLoss
    aggregate: Callable[[Tensor, Tensor, Normalizers], Tensor]
    kl_coef: float = 0.0
    """beta of the KL in the loss; 0: none (or in the reward)."""
    kl_estimator: Callable[[Tensor, Tensor], Tensor] | None = None
    entropy_coef: float = 0.0

    @property
    def needs(self) -> frozenset[Role]:
        kl = {Role.PI_REF} if self.kl_coef else set()
        return self.policy_loss.needs | kl

    def __call__(self, logp: Tensor, entropy: Tensor, mb: LossBatch) -> tuple[Tensor, Metrics]:
        mask = mb.loss_mask.to(logp.dtype)
        lp = RoleLogprobs(
            alpha_engine=mb.alpha_engine_logp,
            alpha_trainer=mb.alpha_trainer_logp,
            pi_k=mb.pi_k_logp,
            pi_ref=mb.pi_ref_logp,
        )
        tok_loss, metrics = self.policy_loss(logp, adv=mb.advantages, mask_BT=mask, lp=lp)
        metrics["pg_loss"] = masked_mean(tok_loss, mask)
        if self.kl_coef and self.kl_estimator is not None:
            kl = self.kl_estimator(logp, lp.of(Role.PI_REF))
            tok_loss = tok_loss + self.kl_coef * kl
            metrics["kl_ref"] = masked_mean(kl, mask)
        if self.entropy_coef != 0:
            tok_loss = tok_loss + entropy_bonus(entropy, self.entropy_coef)
        metrics["entropy"] = masked_mean(entropy, mask)
        metrics["num_tokens"] = mask.detach().sum()
        return self.aggregate(tok_loss, mask, mb.normalizers), metrics


def make_loss_fn(grpo_cfg: GRPOConfig, max_response_len: int | None = None) -> GRPOLoss:
    """Build the per-micro-batch ``loss_fn(logp, entropy, mb) -> (loss, metrics)`` once: the
    policy loss (:func:`build_policy_loss`), KL-in-loss and its estimator, the entropy bonus
    and the aggregation mode. ``max_response_len`` (``rollout.max_new_tokens``) is the
    Dr.GRPO constant when ``grpo.loss.loss_agg_constant == 0``."""
    c = grpo_cfg
    kl_in_loss = c.kl.kl_coef > 0 and not c.kl.kl_in_reward
    return GRPOLoss(
        policy_loss=build_policy_loss(c),
        aggregate=_aggregator(c, max_response_len),
        kl_coef=c.kl.kl_coef if kl_in_loss else 0.0,
        kl_estimator=get_kl_estimator(c.kl.kl_estimator) if kl_in_loss else None,
        entropy_coef=c.loss.entropy_coef,
    )
