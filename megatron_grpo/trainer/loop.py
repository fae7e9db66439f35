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
    ref reset  pi_ref <- pi_k every ``grpo.kl.ref_update_interval`` steps
    log        one metrics.jsonl line, TensorBoard, progress bar
    checkpoint when due or on a pre-emption signal (trainer/checkpointer.py)

The batch of step k was sampled from ``policy_version``, the step whose weights vLLM serves
(``SyncSchedule``); its lag is ``(k - 1) - policy_version``. Built by
``trainer.build.build_trainer``; ``start`` makes vLLM serve the starting weights.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from megatron_grpo.algorithms.advantages import AdvantageFn, Advantages
from megatron_grpo.algorithms.aggregation import (
    GRPOLoss,
    compute_global_normalizers,
    normalizer_mask,
)
from megatron_grpo.algorithms.seeds import advantage_seed, mini_batch_seed
from megatron_grpo.algorithms.step_batch import LossBatch, SampledBatch, extend
from megatron_grpo.bridge.accounting import SyncReport
from megatron_grpo.bridge.weight_sync import WeightSender
from megatron_grpo.checkpoint import LoopState, find_latest
from megatron_grpo.config import Config
from megatron_grpo.distributed import ParallelContext
from megatron_grpo.dry_run.budget import TokenBudget
from megatron_grpo.metrics import MetricsLogger, PhaseTimer
from megatron_grpo.metrics.console import console_out, say_rank0
from megatron_grpo.metrics.row import step_row
from megatron_grpo.policy import Policy
from megatron_grpo.rollout.ahead import WindowBuffer
from megatron_grpo.rollout.interface import Rollout, RolloutFailure
from megatron_grpo.rollout.samples import Sample
from megatron_grpo.trainer.checkpointer import Checkpointer, loop_state_of
from megatron_grpo.trainer.collate import collate, mini_batches, with_advantages
from megatron_grpo.trainer.colocated_memory import ColocatedMemory
from megatron_grpo.trainer.logprobs import StepLogprobs
from megatron_grpo.trainer.sync_schedule import SyncSchedule
from megatron_grpo.trainer.validation import Validator
from megatron_grpo.trainer.watchdog import bounded_step

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
    window: WindowBuffer  # each step's prompts, samples and rewards
    advantage_fn: AdvantageFn
    loss_fn: GRPOLoss  # what it reads (``needs``) decides the step's scoring passes
    memory: ColocatedMemory
    checkpointer: Checkpointer
    logger: MetricsLogger
    timer: PhaseTimer
    schedule: SyncSchedule  # when to sync (``SyncSchedule.from_config(cfg.sync)``)
    budget: TokenBudget  # tokens per packed micro-batch (trainer.build sizes it)
    validator: Validator | None = None  # when eval.interval > 0
    alpha: Policy | None = (
        None  # grpo.off_policy.score_alpha, v > 1: a copy of the weights vLLM serves
    )
    start_step: int = 0
    closers: list[Callable[[], None]] = field(default_factory=list)
    logprobs: StepLogprobs = field(init=False)  # the scoring passes outside SGD

    def __post_init__(self) -> None:
        self.logprobs = StepLogprobs(self.cfg, self.ctx, self.policy, self.ref, self.alpha,
                                     self.timer, self.budget.tokens, self.loss_fn.needs)  # fmt: skip

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
            if reward_info.get("ds_fill", 1.0) < 1.0:  # grpo.dynamic_sampling ran out of rounds
                self._say_short_batch(step, reward_info)
            batch = collate(samples, self.tokenizer.pad_token_id)
            with timer.phase("logprobs"), self._bounded(f"the reference log-probs of step {step}"):
                pi_ref, kl_seq = self.logprobs.reference(batch)
            adv = self.group_advantages(rewards, kl_seq, step)
            # bounded too: a peer that hangs (not dies) leaves this rank in the DP group's
            # all-reduce, which megatron's groups time out only after a whole minute at least
            with timer.phase("train"), self._bounded(f"the training of step {step}"):
                train, drift, ratio_parts = self.train_on(batch, adv, pi_ref, step)
            sync_report = eval_metrics = None
            if self.schedule.due(step, drift):
                with timer.phase("sync"), self._bounded(f"the weight sync of step {step}"):
                    sync_report = self.push_weights(step)
            if self.validator is not None and self.validator.due(step):
                with timer.phase("eval"), self._bounded(f"the evaluation of step {step}"):
                    eval_metrics = self.evaluate()
            if g.kl.ref_update_interval and step % g.kl.ref_update_interval == 0 and self.ref:
                self.ref.copy_weights_from(self.policy)  # success-rate amplification
            # Log before saving: a checkpoint is never newer than metrics.jsonl (a resume
            # drops the rows after its step and re-runs them, so no step's row is lost).
            self.logger.log(step_row(
                step, version, rewards, reward_info, samples, adv, train, sync_report,
                timer.times(), time.perf_counter() - t_step, eval_metrics=eval_metrics,
                sync_verify=getattr(self.sender, "last_verify", None),
                gpu_memory=self.memory.take_boundaries(), drift=drift, ratio_parts=ratio_parts,
                routing_mismatch=self.routing_mismatch(),
            ))  # fmt: skip
            if self.checkpointer.after_step(step, loop_state_of(self, step)):
                return {"preempted": True, "step": step}
        return self.finish()

    # ------------------------------------------------------------------------ phases
    def take_batch(self, step: int) -> tuple[list[Any], list[Sample]]:
        """Step ``step``'s prompts and samples, from the sync window's buffer (generated
        once per window with rollout.ahead, else once per step)."""
        try:
            return self.window.take(step)
        except Exception as e:
            latest = find_latest(self.checkpointer.run_dir)
            raise RolloutFailure.during(step, e, latest, self.cfg.run_dir) from e

    def group_advantages(
        self, rewards_PG: torch.Tensor, kl_seq: torch.Tensor | None, step: int
    ) -> Advantages:
        g = self.cfg.grpo
        task_PG = rewards_PG  # the zero-variance mask looks at these, not at the KL penalty
        if kl_seq is not None:
            rewards_PG = rewards_PG - g.kl.kl_coef * kl_seq.view_as(rewards_PG)
        gen = torch.Generator().manual_seed(advantage_seed(self.cfg.seed, step))
        return self.advantage_fn(rewards_PG, gen, task_PG)

    def train_on(
        self, batch: SampledBatch, adv: Advantages, pi_ref: torch.Tensor | None, step: int
    ) -> tuple[list[dict[str, Any]], float | None, dict[str, float] | None]:
        """i SGD iterations over mini-batches of this DP rank's share of the batch; returns
        the optimizer steps' metrics, the drift of pi_k from alpha measured before them
        and, with grpo.off_policy.score_alpha, the ratio's two parts (``StepLogprobs.score``)."""
        g, ctx = self.cfg.grpo, self.ctx
        advantaged = with_advantages(batch, adv, g.overlong_filter)
        lag = step - 1 - self.policy_version
        scored = self.logprobs.score(advantaged, pi_ref, lag, self.schedule.adaptive)
        gen = torch.Generator().manual_seed(mini_batch_seed(self.cfg.seed, step))
        group = ctx.dp_group if ctx.dp > 1 else None
        out = []
        for _ in range(g.batch.sgd_iterations):
            for mini in mini_batches(scored.batch, g.batch.mini_batch_size, ctx.dp, gen):
                norms = compute_global_normalizers(
                    normalizer_mask(mini, g.loss.loss_normalizer), group
                )
                mb = extend(LossBatch, mini, normalizers=norms)
                out.append(
                    self.policy.train_step(
                        mb, self.loss_fn, g.batch.micro_batch_size, token_budget=self.budget.tokens
                    )
                )
        return out, scored.drift, scored.ratio_parts

    def routing_mismatch(self) -> float | None:
        """rollout.routing_replay: the step's share of routings where the policy's router
        chose other experts than vLLM (policy/routing_replay.py); same on every rank."""
        if self.cfg.rollout.routing_replay == "off" or self.policy.routing is None:
            return None
        return self.policy.routing.take_mismatch()

    def push_weights(
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
        report = self.sender.push(weights)
        self.schedule.synced(step)
        self.checkpointer.snapshot_served(weights)
        a = self.alpha
        if a is not None and a is not weights and a is not self.checkpointer.served:
            a.copy_weights_from(
                weights
            )  # grpo.off_policy.score_alpha: alpha follows what vLLM serves
        return report

    def start(self, resumed: tuple[LoopState, Policy] | None = None) -> SyncReport:
        """Before step 1, vLLM serves the starting weights: a fresh run's policy, or (``resumed``:
        ``Checkpointer.resume``'s loop state and served weights) the weights served at the
        checkpoint, with the data stream and the schedule where the checkpoint left them."""
        if resumed is None:
            return self.push_weights(0, initial=True)
        state, served = resumed
        self.start_step = state.step
        self.window.load_data_state(state.data_state)  # loop_state's data_state, read back
        return self.push_weights(state.policy_version, served, initial=True)

    def evaluate(self) -> dict[str, Any]:
        """eval.interval: pass@1 on held-out prompts from the weights vLLM serves now."""
        assert self.validator is not None  # called when validator.due
        self.memory.before_generate()  # vLLM awake, trainer state off the GPU
        try:
            return self.validator.run(self.rollout.generate, self.policy_version)
        finally:
            self.memory.after_generate()

    # ------------------------------------------------------------------------ helpers
    def _say_short_batch(self, step: int, info: dict[str, Any]) -> None:
        """Dynamic sampling's rounds ran out before the batch held prompts_per_step groups
        with reward variance: one line saying how far it got (the row has ``ds_*``)."""
        p, ds = self.cfg.grpo.batch.prompts_per_step, self.cfg.grpo.dynamic_sampling
        filled = round(info["ds_fill"] * p)
        say_rank0(self.ctx, f"step {step}: dynamic sampling filled {filled}/{p} groups with "
                  f"reward variance in {info['ds_rounds']} round(s) of generation "
                  f"(grpo.dynamic_sampling.max_rounds={ds.max_rounds}); the other {p - filled} "
                  "are zero-variance groups, masked")  # fmt: skip

    def _bounded(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Every wait of the loop ends, at the latest after parallel.timeout_s, as a failure
        of the step (watchdog.py)."""
        step = self.checkpointer.last_step + 1
        return bounded_step(
            what, self.cfg.parallel.timeout_s, self.cfg.run_dir, self.ctx.rank, step
        )

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
