"""The step's scoring passes outside the SGD iterations, scheduled from what the loss
declares it reads (``GRPOLoss.needs``, algorithms/policy_loss.py ``Role``): pi_ref's
log-probs (and, for KL-in-reward, the policy's) over the whole batch; pi_k's, scored once
before the first update, which the exact ratio, TIS, the adaptive schedule's drift and
``grpo.off_policy.score_alpha``'s staleness read; alpha's on the trainer
(``grpo.off_policy.score_alpha``). The shard's ``ScoredBatch`` is made here, once. Every
value returned is the same on every rank (DP shards are gathered or summed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_grpo.algorithms.drift import drift_from_sums, k3_drift_sums
from megatron_grpo.algorithms.kl import get_kl_estimator
from megatron_grpo.algorithms.policy_loss import Role
from megatron_grpo.algorithms.staleness import decomposition_metrics, decomposition_sums
from megatron_grpo.algorithms.step_batch import (
    AdvantagedBatch,
    Rows,
    SampledBatch,
    ScoredBatch,
    extend,
)
from megatron_grpo.config import Config, GRPOConfig
from megatron_grpo.distributed import ParallelContext
from megatron_grpo.policy import Policy
from megatron_grpo.trainer.collate import dp_rows, dp_shard


def dp_logprobs(
    policy: Policy, batch: Rows, ctx: ParallelContext, micro_batch_size: int,
    token_budget: int | None,
) -> torch.Tensor:  # fmt: skip
    """``policy``'s log-probs of the whole batch [N, L]: each DP rank computes its own
    shard (``dp_shard``'s rows) and the shards are all-gathered over the DP group."""
    shard = dp_shard(batch, ctx.dp_rank, ctx.dp)
    logp = policy.compute_logprobs(shard, micro_batch_size, token_budget=token_budget)["logp"]
    if ctx.dp == 1:
        return logp
    parts = [torch.empty_like(logp) for _ in range(ctx.dp)]
    dist.all_gather(parts, logp, group=ctx.dp_group)
    return torch.cat(parts)


def measure_drift(
    pi_k_logp: torch.Tensor, alpha_logp: torch.Tensor, response_mask: torch.Tensor,
    ctx: ParallelContext,
) -> float:  # fmt: skip
    """Token-mean k3 estimate of KL(alpha || pi_k) over the whole batch's response tokens
    (algorithms/drift.py), the same value on every rank: the DP shards' sums are added,
    then the world takes the largest value (all ranks hold the same one up to rounding;
    a decision read from it cannot differ between ranks). ``alpha_logp``: the engine's, or
    with grpo.off_policy.score_alpha the trainer's (the drift is then the staleness KL, without the
    engines' numerics)."""
    sums = k3_drift_sums(pi_k_logp, alpha_logp, response_mask)
    if ctx.dp > 1:
        dist.all_reduce(sums, group=ctx.dp_group)
    drift = torch.tensor([drift_from_sums(sums)], dtype=torch.float64)
    if ctx.world_size > 1:
        dist.all_reduce(drift, op=dist.ReduceOp.MAX)
    return float(drift.item())


def split_ratio(
    pi_k_logp: torch.Tensor, alpha_trainer_logp: torch.Tensor, shard: SampledBatch,
    grpo_cfg: GRPOConfig, ctx: ParallelContext,
) -> dict[str, float]:  # fmt: skip
    """grpo.off_policy.score_alpha: the step's staleness / numerics metrics
    (algorithms/staleness.py), the same on every rank."""
    g = grpo_cfg
    tis = (
        None
        if g.off_policy.tis == "none"
        else (g.off_policy.tis.startswith("token"), g.off_policy.tis_cap)
    )
    sums, maxima = decomposition_sums(
        pi_k_logp, alpha_trainer_logp, shard.alpha_engine_logp, shard.response_mask, tis
    )
    if ctx.dp > 1:
        dist.all_reduce(sums, group=ctx.dp_group)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=ctx.dp_group)
    return decomposition_metrics(sums, maxima, with_tis=tis is not None)


@dataclass(frozen=True)
class Scored:
    """``StepLogprobs.score``'s result: the shard's ``ScoredBatch``, the drift of pi_k from
    alpha (None when nothing scored pi_k) and ``grpo.off_policy.score_alpha``'s ratio parts."""

    batch: ScoredBatch
    drift: float | None
    ratio_parts: dict[str, float] | None


@dataclass(eq=False)
class StepLogprobs:
    """The step's scoring passes outside the SGD iterations, for ``GRPOTrainer``: the ones
    ``needs`` (the loss's declaration) and the run's measures call for."""

    cfg: Config
    ctx: ParallelContext
    policy: Policy
    ref: Policy | None  # pi_ref; None without a KL term
    alpha: Policy | None  # grpo.off_policy.score_alpha, v > 1: the kept copy of the served weights
    timer: Any
    token_budget: int | None
    needs: frozenset[Role]

    def whole_batch(self, policy: Policy, batch: Rows) -> torch.Tensor:
        return dp_logprobs(
            policy, batch, self.ctx, self.cfg.grpo.batch.micro_batch_size, self.token_budget
        )

    def reference(self, batch: SampledBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """pi_ref's log-probs of the whole batch [N, L] when the loss reads them or the KL is
        in the reward, and then the per-sequence KL for KL-in-reward [N] (else None)."""
        g = self.cfg.grpo
        if self.ref is None or not (Role.PI_REF in self.needs or g.kl.kl_in_reward):
            return None, None
        pi_ref = self.whole_batch(self.ref, batch)
        if not g.kl.kl_in_reward:
            return pi_ref, None
        logp = self.whole_batch(self.policy, batch)
        kl = get_kl_estimator(g.kl.kl_estimator)(logp, pi_ref) * batch.response_mask
        return pi_ref, kl.sum(dim=1)

    def score(
        self, batch: AdvantagedBatch, pi_ref: torch.Tensor | None, lag: int, adaptive: bool
    ) -> Scored:
        """This rank's DP shard of ``batch`` with the trainer's log-probs its loss reads:
        pi_ref's rows of ``pi_ref`` (``reference``), pi_k's scored once before the first
        update, alpha's on the trainer; and the drift (adaptive schedule, pi_k read, or
        score_alpha) and score_alpha's ratio parts. ``lag``: the batch's lag."""
        g, ctx = self.cfg.grpo, self.ctx
        shard = dp_shard(batch, ctx.dp_rank, ctx.dp)
        # grpo.off_policy.score_alpha measures the parts even where the loss reads pi_k alone
        with_alpha = Role.ALPHA_TRAINER in self.needs or g.off_policy.score_alpha
        drift = parts = pi_k = alpha = None
        if Role.PI_K in self.needs or adaptive or with_alpha:
            pi_k = self.policy.compute_logprobs(
                shard, g.batch.micro_batch_size, token_budget=self.token_budget
            )["logp"]
            # at lag 0 the trainer holds alpha itself: pi_k's log-probs are alpha's (no
            # extra pass; the staleness is exactly 0)
            alpha = (self._alpha(shard) if lag else pi_k) if with_alpha else None
            if alpha is not None and g.off_policy.score_alpha:
                parts = split_ratio(pi_k, alpha, shard, g, ctx)
            alpha_for_drift = shard.alpha_engine_logp if alpha is None else alpha
            drift = measure_drift(pi_k, alpha_for_drift, shard.response_mask, ctx)
        if pi_ref is not None and Role.PI_REF in self.needs:
            pi_ref = pi_ref[dp_rows(batch.num_rows, ctx.dp_rank, ctx.dp)]
        else:
            pi_ref = None
        pi_k = pi_k if Role.PI_K in self.needs else None
        alpha = alpha if Role.ALPHA_TRAINER in self.needs else None
        scored = extend(
            ScoredBatch, shard, pi_ref_logp=pi_ref, pi_k_logp=pi_k, alpha_trainer_logp=alpha
        )
        return Scored(scored, drift, parts)

    def _alpha(self, shard: Rows) -> torch.Tensor:
        if self.alpha is None:
            raise RuntimeError(
                "the loss reads alpha_trainer's log-probs at lag > 0 but the run keeps no copy "
                "of the served weights: set grpo.off_policy.score_alpha=true."
            )
        with self.timer.phase("score_alpha"):  # inside "train": its cost, for the bench
            return self.alpha.compute_logprobs(
                shard, self.cfg.grpo.batch.micro_batch_size, token_budget=self.token_budget
            )["logp"]
