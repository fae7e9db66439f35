"""Log-probs the step scores outside the SGD passes, and what it reads from them: pi_ref's
(and, for KL-in-reward, the policy's) over the whole batch, and pi_k's (``old_logp``),
scored once before the first update: the exact ratio's r', the adaptive schedule's drift
and ``grpo.score_alpha``'s staleness all read them. Every value returned is the same on
every rank (DP shards are gathered or summed)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_grpo.algorithms.drift import drift_from_sums, k3_drift_sums
from megatron_grpo.algorithms.kl import get_kl_estimator
from megatron_grpo.algorithms.staleness import decomposition_metrics, decomposition_sums
from megatron_grpo.algorithms.step_batch import StepBatch
from megatron_grpo.distributed import ParallelContext
from megatron_grpo.trainer.collate import dp_shard


def dp_logprobs(
    policy, batch: StepBatch, ctx: ParallelContext, micro_batch_size: int, token_budget: int | None
) -> torch.Tensor:
    """``policy``'s log-probs of the whole batch [N, L]: each DP rank computes its own
    shard (``dp_shard``'s rows) and the shards are all-gathered over the DP group."""
    shard = dp_shard(batch, ctx.dp_rank, ctx.dp)
    logp = policy.compute_logprobs(shard, micro_batch_size, token_budget=token_budget)["logp"]
    if ctx.dp == 1:
        return logp
    parts = [torch.empty_like(logp) for _ in range(ctx.dp)]
    dist.all_gather(parts, logp, group=ctx.dp_group)
    return torch.cat(parts)


def measure_drift(old_logp: torch.Tensor, shard: StepBatch, ctx: ParallelContext) -> float:
    """Token-mean k3 estimate of KL(alpha || pi_k) over the whole batch's response tokens
    (algorithms/drift.py), the same value on every rank: the DP shards' sums are added,
    then the world takes the largest value (all ranks hold the same one up to rounding;
    a decision read from it cannot differ between ranks). With grpo.score_alpha the
    shard holds alpha_trainer (:func:`split_ratio`, run before): the drift is the staleness
    KL, without the engines' numerics."""
    alpha_logp = shard["alpha_logp"] if "alpha_logp" in shard else shard["rollout_logp"]
    sums = k3_drift_sums(old_logp, alpha_logp, shard["response_mask"])
    if ctx.dp > 1:
        dist.all_reduce(sums, group=ctx.dp_group)
    drift = torch.tensor([drift_from_sums(sums)], dtype=torch.float64)
    if ctx.world_size > 1:
        dist.all_reduce(drift, op=dist.ReduceOp.MAX)
    return float(drift.item())


def split_ratio(old_logp: torch.Tensor, shard: StepBatch, grpo_cfg, ctx: ParallelContext,
                score_alpha: Callable[[StepBatch], torch.Tensor] | None) -> dict[str, float]:  # fmt: skip
    """grpo.score_alpha: alpha's log-probs on the trainer (``shard["alpha_logp"]``) and the
    step's staleness / numerics metrics (algorithms/staleness.py), the same on every rank.
    ``score_alpha``: the kept copy of the served weights scoring the shard; None at lag 0,
    where the trainer holds alpha itself: pi_k's log-probs are alpha's (no extra pass; the
    staleness is exactly 0)."""
    g = grpo_cfg
    shard["alpha_logp"] = old_logp if score_alpha is None else score_alpha(shard)
    tis = None if g.tis == "none" else (g.tis.startswith("token"), g.tis_cap)
    sums, maxima = decomposition_sums(
        old_logp, shard["alpha_logp"], shard["rollout_logp"], shard["response_mask"], tis
    )
    if ctx.dp > 1:
        dist.all_reduce(sums, group=ctx.dp_group)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=ctx.dp_group)
    return decomposition_metrics(sums, maxima, with_tis=tis is not None)


@dataclass(eq=False)
class StepLogprobs:
    """The step's scoring passes outside the SGD iterations, for ``GRPOTrainer``."""

    cfg: Any
    ctx: ParallelContext
    policy: Any
    ref: Any  # pi_ref; None without a KL term
    alpha: Any  # grpo.score_alpha, v > 1: the kept copy of the served weights
    timer: Any
    token_budget: int | None

    def whole_batch(self, policy, batch: StepBatch) -> torch.Tensor:
        return dp_logprobs(
            policy, batch, self.ctx, self.cfg.grpo.micro_batch_size, self.token_budget
        )

    def reference(self, batch: StepBatch) -> tuple[StepBatch, torch.Tensor | None]:
        """pi_ref's log-probs when the KL needs them; the per-sequence KL for KL-in-reward."""
        g = self.cfg.grpo
        if self.ref is None:
            return batch, None
        batch["ref_logp"] = self.whole_batch(self.ref, batch)
        if not g.kl_in_reward:
            return batch, None
        logp = self.whole_batch(self.policy, batch)
        kl = get_kl_estimator(g.kl_estimator)(logp, batch["ref_logp"]) * batch["loss_mask"]
        return batch, kl.sum(dim=1)

    def before_sgd(
        self, shard: StepBatch, lag: int, adaptive: bool
    ) -> tuple[float | None, dict[str, float] | None]:
        """pi_k's log-probs of this rank's shard, scored once before the first update when
        something reads them (``grpo.ratio_mode=exact`` puts them in ``shard["old_logp"]``);
        returns the drift (adaptive schedule, exact, score_alpha) and, with
        ``grpo.score_alpha``, the ratio's two parts; ``lag``: the batch's lag."""
        g = self.cfg.grpo
        if not (g.ratio_mode == "exact" or adaptive or g.score_alpha):
            return None, None
        old_logp = self.policy.compute_logprobs(
            shard, g.micro_batch_size, token_budget=self.token_budget
        )["logp"]
        parts = None
        if g.score_alpha:
            parts = split_ratio(old_logp, shard, g, self.ctx, self._alpha if lag else None)
        drift = measure_drift(old_logp, shard, self.ctx)
        if g.ratio_mode == "exact":
            shard["old_logp"] = old_logp
        return drift, parts

    def _alpha(self, shard: StepBatch) -> torch.Tensor:
        with self.timer.phase("score_alpha"):  # inside "train": its cost, for the bench
            return self.alpha.compute_logprobs(
                shard, self.cfg.grpo.micro_batch_size, token_budget=self.token_budget
            )["logp"]
