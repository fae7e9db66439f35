"""Group advantages: GRPO whitening, Dr.GRPO centering, RED-Drop, RED-Weight, zero-variance mask.

Shape convention: rewards are a dense ``[P, G]`` tensor, P prompts by G responses each, and
sample ``b`` of the flat rollout batch is ``(p, g) = divmod(b, G)`` (``rewards_PG.reshape(-1)``
is the batch order). A dense tensor keeps every group operation a reduction over ``dim=1``;
groups of unequal size are not needed because every prompt gets exactly G responses.

Every function is pure tensor math; :func:`build_advantage_fn` picks the variant once from
``GRPOConfig`` and returns a closure. Sources: Mroueh et al. 2505.22257 eq. (2) (whitening)
and eq. (8) (zero-variance mask); Yao et al. 2509.24203 (RED-Drop, RED-Weight); Liu et al.
2503.20783 (Dr.GRPO: no std division).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_grpo.config.schema import GRPOConfig


def _check_2d(rewards_PG: Tensor) -> None:
    if rewards_PG.dim() != 2:
        raise ValueError(
            f"rewards must be [P, G] (prompts x group), got shape {tuple(rewards_PG.shape)}: "
            "reshape the flat batch with rewards.view(num_prompts, group_size)."
        )


def _group_mean(rewards_PG: Tensor, keep_PG: Tensor | None) -> tuple[Tensor, Tensor]:
    """Mean over the kept members of each group -> ``(mean_P1, count_P1)``."""
    if keep_PG is None:
        n = torch.full_like(rewards_PG[:, :1], rewards_PG.shape[1])
        return rewards_PG.mean(dim=1, keepdim=True), n
    k = keep_PG.to(rewards_PG.dtype)
    n = k.sum(dim=1, keepdim=True)
    return (rewards_PG * k).sum(dim=1, keepdim=True) / n.clamp(min=1), n


def group_center(rewards_PG: Tensor, keep_PG: Tensor | None = None) -> Tensor:
    """Dr.GRPO advantage ``A = r - mean_G(r)`` (no std division).

    Args:
        rewards_PG: ``[P, G]`` rewards.
        keep_PG: optional ``[P, G]`` bool; the mean runs over kept members only and dropped
            members get advantage 0.
    Returns:
        ``[P, G]`` advantages.
    """
    _check_2d(rewards_PG)
    mean, _ = _group_mean(rewards_PG, keep_PG)
    adv = rewards_PG - mean
    return adv if keep_PG is None else adv * keep_PG.to(adv.dtype)


def group_whiten(rewards_PG: Tensor, eps: float, keep_PG: Tensor | None = None) -> Tensor:
    """GRPO advantage ``A = (r - mean) / sqrt(std^2 + eps)`` with the population std.

    Off-policy GRPO eq. (2) (Mroueh et al.): mean and std are over the G responses of one
    prompt; ``eps`` sits under the square root as in the paper.

    Args:
        rewards_PG: ``[P, G]`` rewards.
        eps: variance floor (``grpo.advantage_eps``).
        keep_PG: optional ``[P, G]`` bool; statistics over kept members only (RED-Drop),
            dropped members get advantage 0.
    Returns:
        ``[P, G]`` advantages.
    """
    _check_2d(rewards_PG)
    mean, n = _group_mean(rewards_PG, keep_PG)
    dev = rewards_PG - mean
    if keep_PG is not None:
        dev = dev * keep_PG.to(dev.dtype)
    var = (dev * dev).sum(dim=1, keepdim=True) / n.clamp(min=1)  # population variance
    denom = torch.sqrt(var + eps)
    # eps = 0 and a constant group give 0/0: such a group carries no signal, so 0, not NaN.
    return torch.where(denom > 0, dev / denom.clamp(min=torch.finfo(dev.dtype).tiny), 0.0)


def red_weight(adv_PG: Tensor, tau: float) -> Tensor:
    """RED-Weight (Yao et al.): ``A * exp(A / tau)`` on unnormalized (centered) advantages.

    Up-weights samples far above the group mean and shrinks those below it.

    Args:
        adv_PG: ``[P, G]`` (or any shape) centered advantages ``r - mean``.
        tau: temperature (> 0).
    """
    return adv_PG * torch.exp(adv_PG / tau)


def zero_variance_mask(rewards_PG: Tensor) -> Tensor:
    """``1[sigma(x) != 0]`` per prompt (off-policy GRPO eq. 8): ``[P]`` bool.

    Tested as max != min, which is exact; a float std of equal values can be a tiny nonzero.
    """
    _check_2d(rewards_PG)
    return rewards_PG.amax(dim=1) != rewards_PG.amin(dim=1)


def red_drop_keep(rewards_PG: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """RED-Drop (Yao et al.): which samples to keep, ``[P, G]`` bool.

    In a group with more negatives (``r < mean``) than positives (``r >= mean``), drop
    ``n_neg - n_pos`` negatives chosen uniformly at random (``generator`` seeds the draw) so
    that the kept counts balance. Positives are always kept.

    Ties: a sample equal to the group mean (advantage 0) counts as positive, as in the REC
    paper's released code (Trinity-RFT, which the paper names as its source); with 0/1
    rewards no sample equals the mean of a mixed group, so this only matters for graded
    rewards, where it drops fewer negatives than counting ``r > mean`` would.
    """
    _check_2d(rewards_PG)
    mean = rewards_PG.mean(dim=1, keepdim=True)
    neg = rewards_PG < mean
    pos = ~neg
    surplus = (neg.sum(dim=1) - pos.sum(dim=1)).clamp(min=0)  # [P]
    scores = torch.rand(rewards_PG.shape, generator=generator, dtype=torch.float64)
    scores = torch.where(neg, scores, torch.full_like(scores, 2.0))  # non-negatives rank last
    rank = scores.argsort(dim=1).argsort(dim=1)  # rank of each sample among its group
    drop = neg & (rank < surplus[:, None])
    return ~drop


@dataclass(frozen=True)
class Advantages:
    """Output of an advantage function.

    ``advantages``: ``[P, G]`` float, 0 where not kept.
    ``keep``: ``[P, G]`` bool; False for RED-Drop's dropped samples and zero-variance groups.
    The trainer's ``loss_mask`` is the response mask times ``keep.reshape(-1)[:, None]``
    (trainer/collate.py ``with_advantages``), so a dropped sample contributes neither loss,
    KL nor a token count.
    ``metrics``: scalars (python floats) for logging.
    """

    advantages: Tensor
    keep: Tensor
    metrics: dict[str, float]


AdvantageFn = Callable[..., Advantages]


def build_advantage_fn(grpo_cfg: GRPOConfig) -> AdvantageFn:
    """Pick the advantage variant once from ``grpo.{advantage, red_drop, zero_variance_mask}``.

    Returns ``fn(rewards_PG, generator, task_rewards_PG=None) -> Advantages``. Order: RED-Drop
    picks the kept set, the base advantage is computed over it, then zero-variance groups are
    masked. ``task_rewards_PG`` (default: ``rewards_PG``) are the rewards the zero-variance
    mask looks at: with the KL in the reward, ``rewards_PG`` carries ``-beta*KL`` and a group
    of equal task rewards would otherwise be kept and its pure KL differences whitened to
    unit scale; the paper masks by the task rewards' variance (eq. 8).
    """
    eps, tau = grpo_cfg.advantage_eps, grpo_cfg.red_weight_tau
    base: Callable[[Tensor, Tensor | None], Tensor]
    if grpo_cfg.advantage == "grpo":

        def base(r: Tensor, keep: Tensor | None) -> Tensor:
            return group_whiten(r, eps, keep)
    elif grpo_cfg.advantage == "drgrpo":
        base = group_center
    elif grpo_cfg.advantage == "red_weight":

        def base(r: Tensor, keep: Tensor | None) -> Tensor:
            return red_weight(group_center(r, keep), tau)
    else:  # the config validates choices; this guards direct construction
        raise ValueError(f"grpo.advantage={grpo_cfg.advantage!r}: use grpo, drgrpo or red_weight.")
    use_drop, use_zv = grpo_cfg.red_drop, grpo_cfg.zero_variance_mask

    def advantage_fn(
        rewards_PG: Tensor,
        generator: torch.Generator | None = None,
        task_rewards_PG: Tensor | None = None,
    ) -> Advantages:
        _check_2d(rewards_PG)
        rewards_PG = rewards_PG.to(torch.float32)
        task = rewards_PG if task_rewards_PG is None else task_rewards_PG.to(torch.float32)
        keep = red_drop_keep(rewards_PG, generator) if use_drop else None
        adv = base(rewards_PG, keep)
        if keep is None:
            keep = torch.ones_like(rewards_PG, dtype=torch.bool)
        dropped = float((~keep).float().mean())
        zv = zero_variance_mask(task)
        if use_zv:
            keep = keep & zv[:, None]
        adv = torch.where(keep, adv, 0.0)  # where, not *, so a NaN cannot leak through
        metrics = {
            "reward_mean": float(rewards_PG.mean()),
            "frac_zero_variance_groups": float((~zv).float().mean()),
            "frac_dropped": dropped,
            "frac_kept": float(keep.float().mean()),
            "adv_abs_mean": float(adv.abs().mean()),
        }
        return Advantages(adv, keep, metrics)

    return advantage_fn
