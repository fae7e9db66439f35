"""Build a run's parts once, in the order that fails cheapest first, and run it.

``build_trainer``: checks (``trainer.preflight``) -> model directory -> process groups ->
policy (+ pi_ref, + the served copy for exact resume or grpo.off_policy.score_alpha) -> engines and
weight sender (``rollout.interface``) -> data, rewards, losses -> resume -> metrics -> the
trainer, whose ``start`` pushes the starting weights (the initial sync).
``train``: build, ``GRPOTrainer.run``, tear down (every process started here is stopped).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from megatron_grpo.algorithms.advantages import build_advantage_fn
from megatron_grpo.algorithms.aggregation import make_loss_fn
from megatron_grpo.algorithms.policy_loss import Role
from megatron_grpo.checkpoint import LoopState
from megatron_grpo.config import Config, format_config, save_config
from megatron_grpo.data import PromptSource, build_prompt_source
from megatron_grpo.distributed import ParallelContext, destroy_distributed, init_distributed
from megatron_grpo.distributed.placement import validate_world
from megatron_grpo.dry_run.budget import TokenBudget, resolve_token_budget
from megatron_grpo.layouts.io import load_hf_into_megatron
from megatron_grpo.metrics import MetricsLogger, PhaseTimer
from megatron_grpo.metrics.console import console_err, say, say_rank0
from megatron_grpo.models.prepare import prepare_model_dir
from megatron_grpo.models.spec import ModelSpec, load_spec
from megatron_grpo.policy import Policy
from megatron_grpo.policy.policy import build_policy
from megatron_grpo.rewards import RewardFn, build_reward
from megatron_grpo.rewards.judge import client_config, is_judge
from megatron_grpo.rewards.scoring import GroupScorer
from megatron_grpo.rollout.ahead import WindowBuffer
from megatron_grpo.rollout.interface import Rollout, RolloutFactory, build_rollout, sampling_args
from megatron_grpo.rollout.judge import JudgeProcess, start_judge
from megatron_grpo.rollout.server import DisaggregatedWorld, join_world, serve
from megatron_grpo.trainer.checkpointer import Checkpointer, Preemption
from megatron_grpo.trainer.colocated_memory import ColocatedMemory
from megatron_grpo.trainer.loop import GRPOTrainer
from megatron_grpo.trainer.preflight import check_run
from megatron_grpo.trainer.restarts import Attempt, note_failure, restart_line
from megatron_grpo.trainer.sync_schedule import SyncSchedule
from megatron_grpo.trainer.validation import Validator


def build_trainer(
    cfg: Config,
    resume: bool = False,
    world: DisaggregatedWorld | None = None,
    rollout_factory: RolloutFactory | None = None,
) -> GRPOTrainer:
    """``world``: this trainer rank's ``rollout.server.DisaggregatedWorld`` when
    ``rollout.placement=disaggregated`` (None: colocated). ``rollout_factory``: what builds
    the engines and the weight sender, ``(cfg, world, ctx, hf_dir, policy) -> (Rollout,
    WeightSender)``; None is vLLM's (``rollout.interface.build_rollout``). The GPU suite
    passes one whose engine samples with transformers behind the same bridge
    (tests/gpu/hf_engine.py), where vLLM's CUDA build is not installed."""
    preemption = Preemption()  # first: a signal during start-up must not kill the process
    from transformers import AutoTokenizer  # heavy

    rank = int(os.environ.get("RANK", "0"))
    # Layout, reward and data checks: one line now, not after the warm start or vLLM.
    num_engines = check_run(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    loss_fn = make_loss_fn(cfg.grpo, cfg.rollout.max_new_tokens)  # a user's loss loads here
    hf_dir = prepare_model_dir(cfg, rank, cfg.parallel.timeout_s)
    spec = load_spec(hf_dir)
    sub_world = world.trainer_world() if world is not None else {}  # the trainer ranks only
    ctx = init_distributed(cfg.parallel, spec, seed=cfg.seed, **sub_world)
    _say_run(cfg, ctx, hf_dir, spec, num_engines)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    policy, ref, served, alpha = _build_policies(cfg, spec, ctx, hf_dir, loss_fn.needs)
    budget = gpu_token_budget(spec, cfg, ctx)
    say_rank0(ctx, f"micro-batches: {budget.line()}")
    t0 = time.perf_counter()
    rollout, sender = (rollout_factory or build_rollout)(cfg, world, ctx, hf_dir, policy)
    say_rank0(ctx, f"vLLM engine up in {time.perf_counter() - t0:.1f}s")
    # vLLM sleeps / the trainer offloads in turns on a colocated GPU (inactive on CPU).
    memory = ColocatedMemory.from_config(cfg, getattr(rollout, "engine", None), policy, ctx.device)
    checkpointer = Checkpointer(cfg.run_dir, cfg.checkpoint, cfg.steps, ctx, policy, ref,
                                served, memory, cfg.parallel.timeout_s, preemption)  # fmt: skip
    reward_fn, stop_judge = _build_reward(cfg, ctx, rollout)
    prompts = build_prompt_source(cfg.data, tokenizer)
    scorer = GroupScorer.from_config(cfg, reward_fn, tokenizer)
    schedule = SyncSchedule.from_config(cfg.sync)
    window = window_buffer(cfg, prompts, rollout, memory, tokenizer.eos_token_id, scorer, schedule)
    validator = Validator(cfg, tokenizer, reward_fn) if cfg.eval.interval else None
    resumed = checkpointer.resume() if resume else None
    attempt = Attempt.current()
    if attempt is not None and attempt.number > 0:  # torchrun restarted this worker
        say_rank0(ctx, restart_line(cfg.run_dir, attempt, resumed[0].step if resumed else 0))
    logger = MetricsLogger(
        cfg.run_dir, cfg.logging, cfg.steps, ctx.rank,
        resume_step=resumed[0].step if resumed else None, run_config=dataclasses.asdict(cfg),
        stream=console_err(),
    )  # fmt: skip
    trainer = GRPOTrainer(
        cfg=cfg, ctx=ctx, tokenizer=tokenizer, policy=policy, ref=ref, rollout=rollout,
        sender=sender, schedule=schedule, window=window, advantage_fn=build_advantage_fn(cfg.grpo),
        loss_fn=loss_fn, memory=memory,
        checkpointer=checkpointer, logger=logger, timer=PhaseTimer.for_device(ctx.device),
        validator=validator, alpha=alpha, budget=budget,
        closers=[logger.close, reward_fn.close, *stop_judge, rollout.shutdown, destroy_distributed],
    )  # fmt: skip
    _start(trainer, resumed)
    if ctx.rank == 0:  # only once the run really starts (a failed start leaves none)
        save_config(cfg, cfg.run_dir)
    return trainer


def _say_run(
    cfg: Config, ctx: ParallelContext, hf_dir: Path, spec: ModelSpec, engines: int
) -> None:
    """Rank 0 prints the resolved config, then the model, the layout and the sync schedule."""
    if ctx.rank == 0:
        print(format_config(cfg), flush=True)
    say_rank0(ctx, run_line(cfg, ctx, hf_dir, spec, engines))


def run_line(cfg: Config, ctx: ParallelContext, hf_dir: Path, spec: ModelSpec, engines: int) -> str:
    """The start line: the model (its experts, if any), the layout (cp where > 1, ep for an
    MoE model) and the sync schedule."""
    experts = f", {spec.num_experts} experts top-{spec.moe_topk}" if spec.is_moe else ""
    cp = f" cp={ctx.cp}" if ctx.cp > 1 else ""
    ep = f" ep={ctx.ep}" if spec.is_moe else ""
    return (
        f"model {hf_dir} ({spec.family}{experts}, {spec.num_parameters:,} params); "
        f"world {ctx.world_size}: tp={ctx.tp}{cp} pp={ctx.pp} dp={ctx.dp}{ep}, {engines} "
        f"vLLM engine(s) of tp={cfg.rollout.tp}, {_schedule_text(cfg)}"
    )


def _build_policies(
    cfg: Config, spec: ModelSpec, ctx: ParallelContext, hf_dir: Path, needs: frozenset[Role]
) -> tuple[Policy, Policy | None, Policy | None, Policy | None]:
    """The policy, warm-started from ``hf_dir``, and its copies: pi_ref (grpo.kl.kl_coef > 0,
    or a loss that reads it), the served copy (exact resume of a lagging sync) and alpha
    (a loss that reads alpha_trainer, i.e. grpo.off_policy.score_alpha: the weights vLLM serves, on
    the trainer; the served copy when there is one). ``needs``: what the loss reads."""
    g = cfg.grpo
    batch = g.batch.prompts_per_step * g.group_size
    optimizer_steps = (
        cfg.steps * g.batch.sgd_iterations * (batch // (g.batch.mini_batch_size or batch))
    )
    policy = build_policy(
        spec,
        ctx,
        cfg.model,
        cfg.optim,
        init_weights=partial(load_hf_into_megatron, hf_dir=hf_dir, spec=spec, ctx=ctx),
        total_steps=optimizer_steps,
        temperature=cfg.rollout.temperature,  # log-probs of softmax(logits / T), as sampled
        routing_replay=cfg.rollout.routing_replay == "on",  # vLLM's experts (docs/moe.md)
    )
    ref = policy.make_reference() if g.kl.kl_coef > 0 or Role.PI_REF in needs else None
    keep_served = cfg.checkpoint.exact_resume and cfg.sync.can_lag
    served = policy.make_reference() if keep_served else None
    alpha = None
    if (g.off_policy.score_alpha or Role.ALPHA_TRAINER in needs) and cfg.sync.can_lag:
        alpha = served if served is not None else policy.make_reference()
    return policy, ref, served, alpha


def _build_reward(
    cfg: Config, ctx: ParallelContext, rollout: Rollout
) -> tuple[RewardFn, list[Callable[[], None]]]:
    """The run's reward function and what stops what it started. ``reward.name=judge:DIR``:
    the judge's process starts where the samples are scored (``rollout.share``: every rank
    colocated, trainer rank 0 disaggregated; rollout/judge.py) and the reward is the remote
    client at its URL."""
    if not is_judge(cfg.reward.name):
        return build_reward(cfg.reward, cfg.data), []
    started: list[JudgeProcess] = []

    def start() -> str:
        t0 = time.perf_counter()
        workdir = Path(cfg.run_dir) / "judge" / f"rank{ctx.rank}"
        started.append(start_judge(cfg, workdir))
        say(f"judge {cfg.reward.name} up in {time.perf_counter() - t0:.1f}s "
            f"(log: {workdir}/judge.log)")  # fmt: skip
        return started[-1].url

    try:
        url = rollout.share(start)
        return build_reward(client_config(cfg.reward, url), cfg.data), [p.close for p in started]
    except BaseException:
        for p in started:
            p.close()
        raise


def gpu_token_budget(spec: ModelSpec, cfg: Config, ctx: ParallelContext) -> TokenBudget:
    """The packed micro-batch's token budget: ``auto`` sized by this GPU's memory (the same
    model and bounds as ``plan``'s: ``dry_run.budget``), or, without CUDA, as configured."""
    cuda = ctx.device.type == "cuda"
    capacity = torch.cuda.get_device_properties(ctx.device).total_memory if cuda else None
    colocated = cfg.rollout.placement == "colocated"
    return resolve_token_budget(spec, cfg, dp=ctx.dp, colocated=colocated, capacity_bytes=capacity)


def _start(trainer: GRPOTrainer, resumed: tuple[LoopState, Policy] | None) -> None:
    """vLLM serves the starting weights (``GRPOTrainer.start``); a failed start closes the
    metrics sinks it opened."""
    try:
        report = trainer.start(resumed)
    except BaseException:
        trainer.logger.close()
        raise
    if resumed is None:
        say_rank0(trainer.ctx, f"initial sync: {report.bytes / 2**20:.2f} MiB in "
                  f"{report.seconds:.2f}s (minimal {report.minimal_bytes / 2**20:.2f} MiB)")  # fmt: skip


def _schedule_text(cfg: Config) -> str:
    s = cfg.sync
    if s.mode == "fixed":
        return f"v={s.interval}"
    return f"adaptive sync (drift > {s.max_drift:g}, interval {s.min_interval}..{s.max_interval})"


def window_buffer(cfg: Config, prompts: PromptSource, rollout: Rollout, memory: ColocatedMemory,
                 eos_token_id: int, score: Callable[[list[Any], list[Any]], Any] | None = None,
                 schedule: SyncSchedule | None = None) -> WindowBuffer:  # fmt: skip
    """Each step's prompts (from ``prompts``, a data source), samples and rewards (``score``):
    with rollout.ahead = a, up to a + 1 steps of the sync window are generated at once (0:
    one step at a time, Algorithm 1's serial order) and scored as they arrive; vLLM wakes
    for each generation, not for each step (``memory``).
    ``schedule``: the loop's sync schedule, whose ``window_end`` bounds a window (None: every
    sync.interval steps)."""
    r = cfg.rollout
    sampling = sampling_args(r, cfg.grpo.group_size, eos_token_id)

    def launch(steps: list[Any]) -> list[Any]:
        memory.before_generate()
        try:
            return rollout.launch(steps, **sampling)
        finally:
            memory.after_generate()

    return WindowBuffer(prompts, cfg.grpo.batch.prompts_per_step, r.ahead, cfg.sync.interval,
                        cfg.steps, r.seed, launch, score, rollout.share,
                        schedule.window_end if schedule is not None else None,
                        with_rows=cfg.env.multi_turn,
                        dynamic=cfg.grpo.dynamic_sampling)  # fmt: skip


def train(cfg: Config, resume: bool = False) -> dict[str, Any]:
    """Build the run, train, and tear down (every process started here is stopped).

    ``rollout.placement=disaggregated``: the last ranks serve vLLM (``rollout.server.serve``,
    until trainer rank 0 says stop) and the others train."""
    world = None
    if cfg.rollout.placement == "disaggregated":
        validate_world(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        world = join_world(cfg)
        if not world.is_trainer:
            return serve(cfg, world)
    try:
        trainer = build_trainer(cfg, resume=resume, world=world)
    except BaseException as e:
        if world is not None:
            world.abort(f"trainer rank {world.rank} failed to start: {type(e).__name__}: {e}")
        raise
    try:
        return trainer.run()
    except Exception as e:
        _record_failure(cfg, trainer, e)
        raise
    finally:
        trainer.close()


def _record_failure(cfg: Config, trainer: GRPOTrainer, error: Exception) -> None:
    """Under torchrun --max-restarts: the step and cause for the restarted attempt, and the
    one line when no restart is left (trainer/restarts.py)."""
    note_failure(cfg.run_dir, trainer.ctx.rank, trainer.checkpointer.last_step + 1, error)
