"""The off-policy GRPO training loop: Algorithm 1 of Mroueh et al. (arXiv 2505.22257).

For k = 1..steps (``GRPOTrainer.run``, one screen):
    rollout    prompts -> G responses each from vLLM, which serves alpha = pi_{k-1-lag}
    reward     verifiable rewards: the window buffer's arrivals thread scores each step's
               samples as they arrive (rewards.scoring.GroupScorer, wired in
               trainer.build.window_buffer); the step takes them (KL-in-reward subtracts
               beta * KL(pi||pi_ref) per sequence)
    advantages group whitening, zero-variance mask, RED-Drop/Weight (algorithms.advantages)
    train      i SGD iterations over mini-batches (policy.train_step with algorithms' loss_fn)
    sync       when k % v == 0 (or, sync.mode=adaptive, when pi_k drifted from alpha:
               trainer/sync_schedule.py), the resharding bridge pushes pi_k into vLLM
    ref reset  pi_ref <- pi_k every ``grpo.ref_update_interval`` steps
    log        one metrics.jsonl line, TensorBoard, progress bar
    checkpoint when due or on a pre-emption signal (trainer/checkpointer.py)

Versions: ``policy_version`` is the trainer step whose weights vLLM serves (0 = the
starting weights, pushed once at start); the batch of step k was sampled from that version
and its ``lag`` is ``(k - 1) - policy_version``: 0 when on-policy (v = 1), up to v - 1
(adaptive: up to sync.max_interval - 1).
The trainer is built by ``trainer.build.build_trainer``; its fields are the run's parts, and
``start`` makes vLLM serve the starting weights (a fresh run's, or a resumed checkpoint's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_grpo.algorithms.advantages import AdvantageFn
from megatron_grpo.algorithms.aggregation import compute_global_normalizers, normalizer_mask
from megatron_grpo.algorithms.drift import drift_from_sums, k3_drift_sums
from megatron_grpo.algorithms.kl import get_kl_estimator
from megatron_grpo.algorithms.seeds import advantage_seed, mini_batch_seed
from megatron_grpo.algorithms.shaping import overlong_filter_keep
from megatron_grpo.algorithms.staleness import decomposition_metrics, decomposition_sums
from megatron_grpo.algorithms.step_batch import LossFn
from megatron_grpo.bridge.accounting import SyncReport
from megatron_grpo.bridge.weight_sync import WeightSender
from megatron_grpo.checkpoint import LoopState, find_latest
from megatron_grpo.config import Config
from megatron_grpo.distributed import ParallelContext
from megatron_grpo.dry_run.budget import TokenBudget, resolve_token_budget
from megatron_grpo.metrics import MetricsLogger, PhaseTimer
from megatron_grpo.metrics.console import console_out, say_rank0
from megatron_grpo.metrics.row import step_row
from megatron_grpo.policy import Policy
from megatron_grpo.rollout.ahead import AheadRollout
from megatron_grpo.rollout.interface import Rollout, RolloutFailure
from megatron_grpo.trainer.batch import collate, dp_shard, mini_batches
from megatron_grpo.trainer.checkpointer import Checkpointer
from megatron_grpo.trainer.memory import ColocatedMemory
from megatron_grpo.trainer.sync_schedule import SyncSchedule
from megatron_grpo.trainer.validation import Validator
from megatron_grpo.trainer.watchdog import bounded

if TYPE_CHECKING:  # transformers is heavy: imported when the run is built (trainer.build)
    from transformers import PreTrainedTokenizerBase


@dataclass(eq=False)
class GRPOTrainer:
    """Everything a run holds, built once (``trainer.build``); ``run()`` is the loop."""

    cfg: Config
    ctx: ParallelContext
    tokenizer: PreTrainedTokenizerBase
    policy: Policy
    ref: Policy | None  # pi_ref; None without a KL term
    rollout: Rollout
    sender: WeightSender  # the bridge: pushes the policy's weights into the engines
    window: AheadRollout  # the window buffer: each step's prompts, samples and rewards
    advantage_fn: AdvantageFn
    loss_fn: LossFn
    memory: ColocatedMemory
    checkpointer: Checkpointer
    logger: MetricsLogger
    timer: PhaseTimer
    validator: Validator | None = None  # when eval.interval > 0
    alpha: Policy | None = None  # grpo.score_alpha, v > 1: a copy of the weights vLLM serves
    schedule: SyncSchedule | None = None  # when to sync; None: built from cfg.sync
    budget: TokenBudget | None = None  # tokens per packed micro-batch; None: resolved off-GPU
    start_step: int = 0
    closers: list[Callable[[], None]] = field(default_factory=list)

    @property
    def token_budget(self) -> int | None:
        """Tokens per packed micro-batch (None: ``micro_batch_size`` padded rows)."""
        return self.budget.tokens

    def __post_init__(self) -> None:
        if self.budget is None:  # as on CPU: no memory model needed (trainer.build sizes it)
            self.budget = resolve_token_budget(
                None, self.cfg, dp=self.ctx.dp, colocated=True, capacity_bytes=None
            )
        if self.schedule is None:
            self.schedule = SyncSchedule.from_config(self.cfg.sync)

    @property
    def policy_version(self) -> int:
        """The step whose weights vLLM serves (kept once: ``SyncSchedule.policy_version``)."""
        return self.schedule.policy_version

    # ------------------------------------------------------------------------ the loop
    def run(self) -> dict[str, Any]:
        cfg, g, timer = self.cfg, self.cfg.grpo, self.timer
        if self.checkpointer.stop_agreed():  # signalled during start-up: nothing to save
            say_rank0(self.ctx, f"preemption signal during start-up: exiting at step {self.start_step}")  # fmt: skip
            return {"preempted": True, "step": self.start_step}
        for step in range(self.start_step + 1, cfg.steps + 1):
            timer.reset()
            t_step = time.perf_counter()
            version = self.policy_version
            with timer.phase("rollout"), self._bounded(f"the rollout of step {step}"):
                prompts, samples = self.take_batch(step)
            with timer.phase("reward"), self._bounded(f"the rewards of step {step}"):
                # GroupScorer's rewards, computed on the window's arrivals thread
                rewards, reward_info = self.window.take_scores()
            batch = collate(samples, self.tokenizer.pad_token_id)
            with timer.phase("logprobs"):
                batch, kl_seq = self.reference_logprobs(batch)
            adv = self.group_advantages(rewards, kl_seq, step)
            with timer.phase("train"):
                train, drift, ratio_parts = self.train_on(batch, adv, step)
            routing = self.routing_mismatch()
            sync_report = eval_metrics = None
            if self.schedule.due(step, drift):
                with timer.phase("sync"), self._bounded(f"the weight sync of step {step}"):
                    sync_report = self.sync(step)
            if self.validator is not None and self.validator.due(step):
                with timer.phase("eval"), self._bounded(f"the evaluation of step {step}"):
                    eval_metrics = self.evaluate()
            if g.ref_update_interval and step % g.ref_update_interval == 0 and self.ref:
                self.ref.copy_weights_from(self.policy)  # success-rate amplification
            # Log before saving: a checkpoint is never newer than metrics.jsonl (a resume
            # drops the rows after its step and re-runs them, so no step's row is lost).
            self.logger.log(step_row(
                step, version, rewards, reward_info, samples, adv, train, sync_report,
                timer.times(), time.perf_counter() - t_step, eval_metrics=eval_metrics,
                sync_verify=getattr(self.sender, "last_verify", None),
                gpu_memory=self.memory.take_boundaries(), drift=drift, ratio_parts=ratio_parts,
                routing_mismatch=routing,
            ))  # fmt: skip
            if self.checkpointer.after_step(step, self.loop_state(step)):
                return {"preempted": True, "step": step}
        return self.finish()

    # ------------------------------------------------------------------------ phases
    def take_batch(self, step: int) -> tuple[list, list]:
        """Step ``step``'s prompts and samples, from the sync window's buffer (generated
        once per window with rollout.ahead, else once per step)."""
        try:
            return self.window.take(step)
        except Exception as e:
            latest = find_latest(self.checkpointer.run_dir)
            where = f"the last checkpoint {latest} is intact" if latest else "no checkpoint yet"
            raise RolloutFailure(
                f"vLLM engine failed during the rollout of step {step} ({type(e).__name__}: "
                f"{e}); {where}. Fix the cause, then continue with `megatron-grpo train --resume "
                f"--run-dir {self.cfg.run_dir}`."
            ) from e

    def reference_logprobs(self, batch):
        """pi_ref's log-probs when the KL needs them; the per-sequence KL for KL-in-reward."""
        g = self.cfg.grpo
        if self.ref is None:
            return batch, None
        batch["ref_logp"] = self._dp_logprobs(self.ref, batch)
        if not g.kl_in_reward:
            return batch, None
        logp = self._dp_logprobs(self.policy, batch)
        kl = get_kl_estimator(g.kl_estimator)(logp, batch["ref_logp"]) * batch["loss_mask"]
        return batch, kl.sum(dim=1)

    def _dp_logprobs(self, policy, batch) -> torch.Tensor:
        """``policy``'s log-probs of the whole batch [N, L]: each DP rank computes its own
        shard (``dp_shard``'s rows) and the shards are all-gathered over the DP group."""
        ctx = self.ctx
        shard = dp_shard(batch, ctx.dp_rank, ctx.dp)
        logp = policy.compute_logprobs(
            shard, self.cfg.grpo.micro_batch_size, token_budget=self.token_budget
        )["logp"]
        if ctx.dp == 1:
            return logp
        parts = [torch.empty_like(logp) for _ in range(ctx.dp)]
        dist.all_gather(parts, logp, group=ctx.dp_group)
        return torch.cat(parts)

    def group_advantages(self, rewards_PG, kl_seq, step):
        g = self.cfg.grpo
        task_PG = rewards_PG  # the zero-variance mask looks at these, not at the KL penalty
        if kl_seq is not None:
            rewards_PG = rewards_PG - g.kl_coef * kl_seq.view_as(rewards_PG)
        gen = torch.Generator().manual_seed(advantage_seed(self.cfg.seed, step))
        return self.advantage_fn(rewards_PG, gen, task_PG)

    def train_on(self, batch, adv, step) -> tuple[list[dict[str, Any]], float | None, dict | None]:
        """i SGD iterations over mini-batches of this DP rank's share of the batch; returns
        the optimizer steps' metrics, the drift of pi_k from alpha measured before them
        (``measure_drift``; None when neither sync.mode=adaptive, ratio_mode=exact nor
        score_alpha) and, with grpo.score_alpha, the ratio's two parts (``split_ratio``)."""
        g, ctx = self.cfg.grpo, self.ctx
        batch["advantages"] = adv.advantages.reshape(-1)
        batch["response_mask"] = batch["loss_mask"]  # grpo.loss_normalizer=all counts these
        keep = adv.keep.reshape(-1, 1).float()
        if g.overlong_filter:  # DAPO: responses cut at max_new_tokens get no gradient
            keep = keep * overlong_filter_keep(batch["truncated"]).reshape(-1, 1).float()
        batch["loss_mask"] = batch["loss_mask"] * keep
        shard = dp_shard(batch, ctx.dp_rank, ctx.dp)
        pi_logp = drift = ratio_parts = None
        # pi_k's log-probs, computed once before the SGD passes: the exact ratio's r', the
        # adaptive schedule's drift and score_alpha's staleness all read them
        if g.ratio_mode == "exact" or self.schedule.adaptive or g.score_alpha:
            pi_logp = self.policy.compute_logprobs(
                shard, g.micro_batch_size, token_budget=self.token_budget
            )["logp"]
            if g.score_alpha:
                ratio_parts = self.split_ratio(pi_logp, shard, step)
            drift = self.measure_drift(pi_logp, shard)
        if g.ratio_mode == "exact":
            shard["old_logp"] = pi_logp
        gen = torch.Generator().manual_seed(mini_batch_seed(self.cfg.seed, step))
        out = []
        for _ in range(g.sgd_iterations):
            for mb in mini_batches(shard, g.mini_batch_size, ctx.dp, gen):
                group = ctx.dp_group if ctx.dp > 1 else None
                mb.update(compute_global_normalizers(normalizer_mask(mb, g.loss_normalizer), group=group))  # fmt: skip
                out.append(
                    self.policy.train_step(
                        mb, self.loss_fn, g.micro_batch_size, token_budget=self.token_budget
                    )
                )
        return out, drift, ratio_parts

    def routing_mismatch(self) -> float | None:
        """With rollout.routing_replay: the share of (token, MoE layer) routings in this
        step's log-prob passes and train steps where the policy's router chose other experts
        than vLLM (policy/routing_replay.py); the same on every rank."""
        if self.cfg.rollout.routing_replay == "off" or self.policy.routing is None:
            return None
        return self.policy.routing.take_mismatch()

    def split_ratio(self, pi_logp, shard, step: int) -> dict[str, float]:
        """grpo.score_alpha: alpha's log-probs on the trainer (``shard["alpha_logp"]``) and
        the step's staleness / numerics metrics (algorithms/staleness.py), the same on every
        rank. At lag 0 the trainer holds alpha itself: pi_k's log-probs are alpha's (no
        extra pass; the staleness is exactly 0); later in a window the kept copy scores them."""
        g, ctx = self.cfg.grpo, self.ctx
        if step - 1 == self.policy_version:
            shard["alpha_logp"] = pi_logp
        else:
            with self.timer.phase("score_alpha"):  # inside "train": its cost, for the bench
                shard["alpha_logp"] = self.alpha.compute_logprobs(
                    shard, g.micro_batch_size, token_budget=self.token_budget
                )["logp"]
        tis = None if g.tis == "none" else (g.tis.startswith("token"), g.tis_cap)
        sums, maxima = decomposition_sums(
            pi_logp, shard["alpha_logp"], shard["rollout_logp"], shard["response_mask"], tis
        )
        if ctx.dp > 1:
            dist.all_reduce(sums, group=ctx.dp_group)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=ctx.dp_group)
        return decomposition_metrics(sums, maxima, with_tis=tis is not None)

    def measure_drift(self, pi_logp, shard) -> float:
        """Token-mean k3 estimate of KL(alpha || pi_k) over the whole batch's response tokens
        (algorithms/drift.py), the same value on every rank: the DP shards' sums are added,
        then the world takes the largest value (all ranks hold the same one up to rounding;
        a decision read from it cannot differ between ranks). With grpo.score_alpha the
        shard holds alpha_trainer (``split_ratio``, run before): the drift is the staleness
        KL, without the engines' numerics."""
        alpha_logp = shard["alpha_logp"] if "alpha_logp" in shard else shard["rollout_logp"]
        sums = k3_drift_sums(pi_logp, alpha_logp, shard["response_mask"])
        if self.ctx.dp > 1:
            dist.all_reduce(sums, group=self.ctx.dp_group)
        drift = torch.tensor([drift_from_sums(sums)], dtype=torch.float64)
        if self.ctx.world_size > 1:
            dist.all_reduce(drift, op=dist.ReduceOp.MAX)
        return float(drift.item())

    def sync(
        self, step: int, weights: Policy | None = None, *, initial: bool = False
    ) -> SyncReport:
        """Push ``weights`` (None: the policy, pi_step) into vLLM, which then serves version
        ``step`` (its weights awake, the trainer's state off the GPU).

        ``initial``: the push before step 1 (``start``), which makes no memory turn: the
        engines start awake and the trainer's state is resident, and ``before_sync`` would
        offload that state one generate early and record phase boundaries no step owns."""
        if not initial:
            self.memory.before_sync()
        weights = self.policy if weights is None else weights
        report = self.sender.sync(weights)
        self.schedule.synced(step)
        self.checkpointer.snapshot_served(weights)
        a = self.alpha
        if a is not None and a is not weights and a is not self.checkpointer.served:
            a.copy_weights_from(weights)  # grpo.score_alpha: alpha follows what vLLM serves
        return report

    def start(self, resumed: tuple[LoopState, Policy] | None = None) -> SyncReport:
        """Before step 1, vLLM serves the starting weights: a fresh run's policy, or (``resumed``:
        ``Checkpointer.resume``'s loop state and served weights) the weights served at the
        checkpoint, with the data stream and the schedule where the checkpoint left them."""
        if resumed is None:
            return self.sync(0, initial=True)
        state, served = resumed
        self.start_step = state.step
        self.window.load_data_state(state.data_state)  # loop_state's data_state, read back
        return self.sync(state.policy_version, served, initial=True)

    def evaluate(self) -> dict[str, Any]:
        """eval.interval: pass@1 on held-out prompts from the weights vLLM serves now."""
        self.memory.before_generate()  # vLLM awake, trainer state off the GPU
        try:
            return self.validator.run(self.rollout.generate, self.policy_version)
        finally:
            self.memory.after_generate()

    # ------------------------------------------------------------------------ helpers
    def _bounded(self, what: str):
        """Every wait of the loop ends, at the latest after parallel.timeout_s (watchdog.py)."""
        return bounded(what, self.cfg.parallel.timeout_s, "parallel.timeout_s bounds it")

    def loop_state(self, step: int) -> LoopState:
        return LoopState(
            step=step, policy_version=self.policy_version,
            sync_phase=step - self.policy_version,
            data_state=self.window.data_state(),  # the consumed steps', not the prefetched
            extra={"layout": {"tp": self.ctx.tp, "pp": self.ctx.pp, "dp": self.ctx.dp},
                   "weight_syncs": self.sender.syncs,
                   # the schedule's state is policy_version; kept to show which mode ran
                   "sync_schedule": {"mode": self.schedule.mode}},
        )  # fmt: skip

    def finish(self) -> dict[str, Any]:
        s = self.cfg.sync
        summary = self.logger.finish(
            s.interval, s.mode, s.max_drift if s.mode == "adaptive" else None
        )
        if self.ctx.rank == 0 and summary:
            print(summary, file=console_out(), flush=True)
        return {"preempted": False, "step": self.cfg.steps}

    def close(self) -> None:
        """Stop everything the run started (metrics sinks, reward workers, engines, groups)."""
        for close in self.closers:
            close()
