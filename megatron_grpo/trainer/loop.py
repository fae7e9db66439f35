"""The off-policy GRPO training loop: Algorithm 1 of Mroueh et al. (arXiv 2505.22257).

For k = 1..steps (``GRPOTrainer.run``, one screen):
    rollout    prompts -> G responses each from vLLM, which serves alpha = pi_{k-1-lag}
    reward     verifiable rewards (KL-in-reward subtracts beta * KL(pi||pi_ref) per sequence)
    advantages group whitening, zero-variance mask, RED-Drop/Weight (algorithms.advantages)
    train      i SGD iterations over mini-batches (policy.train_step with algorithms' loss_fn)
    sync       when k % v == 0, the resharding bridge pushes pi_k into vLLM
    ref reset  pi_ref <- pi_k every ``grpo.ref_update_interval`` steps
    checkpoint every ``checkpoint.interval`` steps, at the end, and on a preemption signal
    log        one metrics.jsonl line, TensorBoard, progress bar

Versions: ``policy_version`` is the trainer step whose weights vLLM serves (0 = the
starting weights, pushed once at start); the batch of step k was sampled from that version
and its ``lag`` is ``(k - 1) - policy_version``: 0 when on-policy (v = 1), up to v - 1.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_grpo.config import Config, ConfigError, format_config, save_config
from megatron_grpo.rollout.ahead import step_seed
from megatron_grpo.trainer.batch import collate, dp_shard, mini_batches

log = logging.getLogger("megatron_grpo.trainer")


class RolloutFailure(RuntimeError):
    """The vLLM engine failed during a rollout; the message names the last checkpoint."""


def _say(ctx, msg: str) -> None:
    if ctx.rank == 0:
        from megatron_grpo.metrics.console import say

        say(msg)


def validate_world(cfg: Config, world_size: int) -> int:
    """Rollout placement against the world size; returns the number of vLLM engines."""
    if cfg.rollout.placement == "disaggregated":
        from megatron_grpo.plan.placement import place_ranks

        engines = len(place_ranks(cfg.rollout, world_size).engines)
        if cfg.sync.method != "direct":
            raise ConfigError(
                f"sync.method={cfg.sync.method!r} gathers full tensors into in-process vLLM "
                "ranks (colocated only): set sync.method=direct with rollout.placement="
                "disaggregated."
            )
        source = f"rollout.num_engines({engines})"
        if cfg.sync.verify:
            raise ConfigError(
                "sync.verify=true reads vLLM's checksums and prompt log-probs in process "
                "(colocated only): set sync.verify=false with rollout.placement=disaggregated."
            )
    else:
        from megatron_grpo.distributed.setup import validate_parallel

        validate_parallel(cfg.parallel, world_size)  # now, not after the warm start
        if world_size % cfg.rollout.tp:
            raise ConfigError(
                f"rollout.tp({cfg.rollout.tp}) does not divide WORLD_SIZE({world_size}): "
                "colocated engines take consecutive groups of rollout.tp ranks; pick a divisor."
            )
        engines = world_size // cfg.rollout.tp
        source = (
            f"the {engines} colocated vLLM engines (WORLD_SIZE {world_size} / rollout.tp "
            f"{cfg.rollout.tp})"
        )
    if cfg.grpo.prompts_per_step % engines:
        raise ConfigError(
            f"grpo.prompts_per_step({cfg.grpo.prompts_per_step}) is not a multiple of {source}: "
            f"make it a multiple of {engines}."
        )
    return engines


def build_rollout(hf_dir, spec, ctx, cfg: Config, policy, **engine_kwargs) -> tuple[Any, Any]:
    """This rank's colocated vLLM engine (serving ``hf_dir``; ``engine_kwargs`` go to
    ``RolloutEngine``) and the resharding bridge that feeds it ``policy``'s shards:
    ``(RolloutEngine, WeightSender)``. Shared with ``megatron-grpo eval`` (trainer/evaluate.py)."""
    from megatron_grpo.bridge.weight_sync import colocated_sender
    from megatron_grpo.rollout.engine import RolloutEngine

    engine = RolloutEngine.from_config(hf_dir, cfg.rollout, **engine_kwargs)
    weight_sync = colocated_sender(hf_dir, spec, ctx, policy, engine, cfg.sync, cfg.rollout.tp)
    return engine, weight_sync


def generate_on_engines(engine, ctx, rollout_tp: int, prompt_ids: list, **sampling) -> list:
    """Colocated engine ``e`` (ranks ``[e*t, (e+1)*t)``) samples prompts
    ``[e*P//E, (e+1)*P//E)`` of the P given (the same list on every rank); every rank gets
    all engines' samples, prompt-major. ``sampling``: ``RolloutEngine.generate``'s keywords."""
    engines = ctx.world_size // rollout_tp
    e, p = ctx.rank // rollout_tp, len(prompt_ids)
    samples = engine.generate(prompt_ids[e * p // engines : (e + 1) * p // engines], **sampling)
    if ctx.world_size == 1:
        return samples
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, samples)
    return [s for k in range(engines) for s in everyone[k * rollout_tp]]


class GRPOTrainer:
    """Everything a run holds, built once; ``run()`` is the loop."""

    def __init__(self, cfg: Config, resume: bool = False, world: Any = None) -> None:
        """``world``: this trainer rank's ``rollout.server.DisaggregatedWorld`` when
        ``rollout.placement=disaggregated`` (None: colocated)."""
        from transformers import AutoTokenizer

        from megatron_grpo.algorithms.advantages import build_advantage_fn
        from megatron_grpo.algorithms.aggregation import make_loss_fn
        from megatron_grpo.data import build_prompt_source
        from megatron_grpo.distributed import init_distributed
        from megatron_grpo.layouts.io import load_hf_into_megatron
        from megatron_grpo.models.spec import load_spec
        from megatron_grpo.policy.policy import build_policy
        from megatron_grpo.rewards import build_reward
        from megatron_grpo.trainer.model_dir import prepare_model_dir
        from megatron_grpo.trainer.preflight import check_run

        self.cfg = cfg
        self.world = world  # disaggregated: the default group is the trainer sub-world
        self.run_dir = Path(cfg.run_dir)
        # Installed first: a pre-emption warning during start-up (model load, engine start)
        # must not kill the process before it can exit cleanly.
        self.stop_requested = False
        self._install_signal_handlers()
        rank = int(os.environ.get("RANK", "0"))
        # Layout, reward and data checks: one line now, not after the warm start or vLLM.
        self.num_engines = check_run(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        self.hf_dir = prepare_model_dir(cfg, rank, cfg.parallel.timeout_s)
        self.spec = load_spec(self.hf_dir)
        sub_world = self.world.trainer_world() if self.world is not None else {}
        self.ctx = ctx = init_distributed(cfg.parallel, self.spec, seed=cfg.seed, **sub_world)
        if ctx.rank == 0:
            print(format_config(cfg), flush=True)
        _say(
            ctx,
            f"model {self.hf_dir} ({self.spec.family}, {self.spec.num_parameters:,} params); "
            f"world {ctx.world_size}: tp={ctx.tp} pp={ctx.pp} dp={ctx.dp}, "
            f"{self.num_engines} vLLM engine(s) of tp={cfg.rollout.tp}, v={cfg.sync.interval}",
        )
        self.tokenizer = AutoTokenizer.from_pretrained(self.hf_dir)
        g = cfg.grpo
        batch = g.prompts_per_step * g.group_size
        mini = g.mini_batch_size or batch
        self.optimizer_steps_per_step = g.sgd_iterations * (batch // mini)
        self.policy = build_policy(
            self.spec, ctx, cfg.model, cfg.optim,
            init_weights=partial(load_hf_into_megatron, hf_dir=self.hf_dir, spec=self.spec, ctx=ctx),
            total_steps=cfg.steps * self.optimizer_steps_per_step,
            temperature=cfg.rollout.temperature,  # log-probs of softmax(logits / T), as sampled
        )  # fmt: skip
        self.ref = self.policy.make_reference() if g.kl_coef > 0 else None
        keep_served = cfg.checkpoint.exact_resume and cfg.sync.interval > 1
        self.served = self.policy.make_reference() if keep_served else None
        t0 = time.perf_counter()
        if self.world is None:
            self.engine, self.weight_sync = build_rollout(
                self.hf_dir, self.spec, ctx, cfg, self.policy
            )
        else:
            from megatron_grpo.rollout.server import connect_rollout

            self.engine, self.weight_sync = connect_rollout(
                cfg, self.world, ctx, self.hf_dir, self.policy
            )
        _say(ctx, f"vLLM engine up in {time.perf_counter() - t0:.1f}s")
        from megatron_grpo.trainer.memory import ColocatedMemory

        # vLLM sleeps / the trainer offloads in turns on a colocated GPU (inactive on CPU).
        self.memory = ColocatedMemory.from_config(cfg, self.engine, self.policy, ctx.device)
        self.prompts = build_prompt_source(cfg.data, self.tokenizer)
        self.ahead = self._build_ahead() if cfg.rollout.ahead else None  # rollout/ahead.py
        self.reward_fn = build_reward(cfg.reward, cfg.data)
        self.advantage_fn = build_advantage_fn(g)
        self.loss_fn = make_loss_fn(g, cfg.rollout.max_new_tokens)
        self.validator = None
        if cfg.eval.interval:
            from megatron_grpo.trainer.validation import Validator

            self.validator = Validator(cfg, self.tokenizer, self.reward_fn)
        self._eval_metrics: dict[str, Any] = {}
        self.start_step, self.policy_version = 0, 0
        if resume:
            self._resume()
        else:
            report = self.weight_sync.sync(self.policy)
            self._snapshot_served()
            _say(ctx, f"initial sync: {report.bytes / 2**20:.2f} MiB in {report.seconds:.2f}s "
                 f"(minimal {report.minimal_bytes / 2**20:.2f} MiB)")  # fmt: skip
        if ctx.rank == 0:  # only once the run really starts (a failed start leaves none)
            save_config(cfg, self.run_dir)
        from megatron_grpo.metrics import MetricsLogger, PhaseTimer
        from megatron_grpo.metrics.console import console_err

        self.timer = PhaseTimer()
        self.logger = MetricsLogger(
            self.run_dir, cfg.logging, cfg.steps, ctx.rank,
            resume_step=self.start_step if resume else None, run_config=dataclasses.asdict(cfg),
            stream=console_err(),
        )  # fmt: skip

    # ------------------------------------------------------------------------ the loop
    def run(self) -> dict[str, Any]:
        cfg, g, timer = self.cfg, self.cfg.grpo, self.timer
        last_saved = self.start_step
        if self._stop_agreed():  # signalled during start-up: nothing new to save
            _say(self.ctx, f"preemption signal during start-up: exiting at step {last_saved}")
            return {"preempted": True, "step": last_saved}
        for step in range(self.start_step + 1, cfg.steps + 1):
            timer.reset()
            t_step = time.perf_counter()
            version = self.policy_version
            with timer.phase("rollout"), self._bounded(f"the rollout of step {step}"):
                self.memory.before_generate()
                prompts, samples = self._rollout_or_fail(step)
                self.memory.after_generate()
            with timer.phase("reward"), self._bounded(f"the rewards of step {step}"):
                rewards, reward_info = self.score(prompts, samples)
            batch = collate(samples, self.tokenizer.pad_token_id)
            with timer.phase("logprobs"):
                batch, kl_seq = self.reference_logprobs(batch)
            adv = self.group_advantages(rewards, kl_seq, step)
            with timer.phase("train"):
                train = self.train_on(batch, adv, step)
            synced = step % cfg.sync.interval == 0
            sync_report = None
            self.memory.before_sync()
            if synced:
                with timer.phase("sync"), self._bounded(f"the weight sync of step {step}"):
                    sync_report = self.sync(step)
            if self.validator is not None and self.validator.due(step):
                with timer.phase("eval"), self._bounded(f"the evaluation of step {step}"):
                    self.memory.before_generate()  # vLLM awake, trainer state off the GPU
                    self._eval_metrics = self.validator.run(self._generate, self.policy_version)
                    self.memory.after_generate()
            if g.ref_update_interval and step % g.ref_update_interval == 0 and self.ref:
                self.ref.copy_weights_from(self.policy)  # success-rate amplification
            # Log before saving: a checkpoint is never newer than metrics.jsonl (a resume
            # drops the rows after its step and re-runs them, so no step's row is lost).
            self.log(step, version, rewards, reward_info, samples, adv, train, sync_report,
                     time.perf_counter() - t_step)  # fmt: skip
            if self._checkpoint_due(step):
                with self._bounded(f"the checkpoint of step {step}"):
                    self.save(step)
                last_saved = step
            if self._stop_agreed():
                if last_saved != step:
                    self.save(step)
                _say(self.ctx, f"preemption signal: checkpoint at step {step} saved, exiting")
                return {"preempted": True, "step": step}
        return self.finish()

    # ------------------------------------------------------------------------ phases
    def rollout(self, step: int):
        """This engine's share of the step's prompts, G samples each; gathered on all ranks.
        With rollout.ahead > 0 the batch comes from the window's prefetch buffer."""
        if self.ahead is not None:
            return self.ahead.take(step)
        cfg = self.cfg
        prompts = self.prompts.next_batch(cfg.grpo.prompts_per_step)  # same on every rank
        samples = self._generate(
            [p.prompt_ids for p in prompts], seed=step_seed(cfg.rollout.seed, step),
            **self._sampling(),
        )  # fmt: skip
        return prompts, samples

    def _sampling(self) -> dict[str, Any]:
        r = self.cfg.rollout
        return dict(n=self.cfg.grpo.group_size, temperature=r.temperature, top_p=r.top_p,
                    top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                    stop_token_ids=[self.tokenizer.eos_token_id])  # fmt: skip

    def _build_ahead(self):
        from megatron_grpo.rollout.ahead import AheadRollout, colocated_launch, queued_launch

        cfg = self.cfg
        if self.world is not None:
            launch = queued_launch(self.engine, self._sampling())
        else:
            launch = colocated_launch(self.engine, self.ctx, cfg.rollout.tp, self._sampling())
        return AheadRollout(self.prompts, cfg.grpo.prompts_per_step, cfg.rollout.ahead,
                            cfg.sync.interval, cfg.steps, cfg.rollout.seed, launch)  # fmt: skip

    def _generate(self, prompt_ids: list, **sampling) -> list:
        """Samples of every prompt from the engines (all ranks get all, prompt-major)."""
        if self.world is not None:  # disaggregated: rollout.server.RolloutClient
            return self.engine.generate(prompt_ids, **sampling)
        return generate_on_engines(self.engine, self.ctx, self.cfg.rollout.tp, prompt_ids,
                                   **sampling)  # fmt: skip

    def _rollout_or_fail(self, step: int):
        try:
            return self.rollout(step)
        except Exception as e:
            from megatron_grpo.checkpoint import find_latest

            latest = find_latest(self.run_dir)
            where = f"the last checkpoint {latest} is intact" if latest else "no checkpoint yet"
            raise RolloutFailure(
                f"vLLM engine failed during the rollout of step {step} ({type(e).__name__}: "
                f"{e}); {where}. Fix the cause, then continue with `megatron-grpo train --resume "
                f"--run-dir {self.run_dir}`."
            ) from e

    def score(self, prompts, samples):
        """Rewards ``[P, G]`` (with DAPO's overlong penalty when grpo.overlong_buffer > 0)."""
        from megatron_grpo.algorithms.shaping import shape_rewards

        g = self.cfg.grpo.group_size
        texts = self.tokenizer.batch_decode(
            [s.response_ids for s in samples], skip_special_tokens=True
        )
        rewards, info = self.reward_fn(
            [prompts[i // g].text for i in range(len(samples))], texts,
            [prompts[i // g].answer for i in range(len(samples))],
        )  # fmt: skip
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        rewards_PG = torch.tensor(rewards, dtype=torch.float32).view(len(prompts), g)
        c = self.cfg
        shaped = shape_rewards(rewards_PG, lengths, c.rollout.max_new_tokens,
                               c.grpo.overlong_buffer, c.grpo.overlong_penalty)  # fmt: skip
        return shaped, info

    def reference_logprobs(self, batch):
        """pi_ref's log-probs when the KL needs them; the per-sequence KL for KL-in-reward."""
        g = self.cfg.grpo
        if self.ref is None:
            return batch, None
        from megatron_grpo.algorithms.kl import get_kl_estimator

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
        logp = policy.compute_logprobs(shard, self.cfg.grpo.micro_batch_size)["logp"]
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
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
        return self.advantage_fn(rewards_PG, gen, task_PG)

    def train_on(self, batch, adv, step) -> list[dict[str, Any]]:
        """i SGD iterations over mini-batches of this DP rank's share of the batch."""
        from megatron_grpo.algorithms.aggregation import compute_global_normalizers, normalizer_mask
        from megatron_grpo.algorithms.shaping import overlong_filter_keep

        g, ctx = self.cfg.grpo, self.ctx
        batch["advantages"] = adv.advantages.reshape(-1)
        batch["response_mask"] = batch["loss_mask"]  # grpo.loss_normalizer=all counts these
        keep = adv.keep.reshape(-1, 1).float()
        if g.overlong_filter:  # DAPO: responses cut at max_new_tokens get no gradient
            keep = keep * overlong_filter_keep(batch["truncated"]).reshape(-1, 1).float()
        batch["loss_mask"] = batch["loss_mask"] * keep
        shard = dp_shard(batch, ctx.dp_rank, ctx.dp)
        if g.ratio_mode == "exact":  # pi_k's log-probs, recomputed once before the SGD passes
            shard["old_logp"] = self.policy.compute_logprobs(shard, g.micro_batch_size)["logp"]
        gen = torch.Generator().manual_seed(self.cfg.seed * 7_654_321 + step)
        out = []
        for _ in range(g.sgd_iterations):
            for mb in mini_batches(shard, g.mini_batch_size, ctx.dp, gen):
                group = ctx.dp_group if ctx.dp > 1 else None
                norm_mask = normalizer_mask(mb, g.loss_normalizer)
                mb.update(compute_global_normalizers(norm_mask, group=group))
                out.append(self.policy.train_step(mb, self.loss_fn, g.micro_batch_size))
        return out

    def sync(self, step: int):
        report = self.weight_sync.sync(self.policy)
        self.policy_version = step
        self._snapshot_served()
        return report

    # ------------------------------------------------------------------------ helpers
    def _bounded(self, what: str):
        """Every wait of the loop ends, at the latest after parallel.timeout_s (watchdog.py)."""
        from megatron_grpo.trainer.watchdog import bounded

        return bounded(what, self.cfg.parallel.timeout_s, "parallel.timeout_s bounds it")

    def _snapshot_served(self) -> None:
        if self.served is not None:
            self.served.copy_weights_from(self.policy)

    def _checkpoint_due(self, step: int) -> bool:
        c = self.cfg.checkpoint
        return bool(c.interval and step % c.interval == 0) or (
            c.save_at_end and step == self.cfg.steps
        )

    def _state_dicts(self, for_loading: bool = False) -> dict[str, Any]:
        parts: dict[str, Any] = {"policy": partial(self.policy.sharded_state_dict, for_loading)}
        if self.ref is not None:
            parts["ref"] = lambda: self.ref.sharded_state_dict()
        if self.served is not None:
            parts["served"] = lambda: self.served.sharded_state_dict()
        return parts

    def save(self, step: int) -> None:
        from megatron_grpo.checkpoint import LoopState, save_checkpoint

        state = LoopState(
            step=step, policy_version=self.policy_version,
            sync_phase=step - self.policy_version,
            # the consumed steps' data position, not the prefetched ones' (rollout.ahead)
            data_state=self.ahead.data_state() if self.ahead else self.prompts.state_dict(),
            extra={"layout": {"tp": self.ctx.tp, "pp": self.ctx.pp, "dp": self.ctx.dp},
                   "weight_syncs": self.weight_sync.syncs},
        )  # fmt: skip
        parts = self._state_dicts()
        if self.served is not None and self.policy_version == step:
            parts.pop("served")  # the served weights are the policy's own
        with self.memory.trainer_resident():
            path = save_checkpoint(
                self.run_dir, state, parts, keep_last=self.cfg.checkpoint.keep_last
            )
        _say(self.ctx, f"checkpoint {path}")

    def _resume(self) -> None:
        from megatron_grpo.checkpoint import find_intact, load_checkpoint

        latest, damaged = find_intact(self.run_dir)
        for reason in damaged:
            _say(self.ctx, f"{reason.split(';')[0]}: skipping it")
        if latest is None:
            raise ConfigError(
                f"--resume: no intact checkpoint under {self.run_dir}/checkpoints; start "
                "without --resume, or point --run-dir at the run to continue."
            )
        if damaged:
            _say(self.ctx, f"falling back to the newest intact checkpoint, {latest.name}")
        templates = {k: v() for k, v in self._state_dicts(for_loading=True).items()}
        loaded = load_checkpoint(latest, templates, optional=("ref", "served"), verify=False)
        self.policy.load_sharded_state_dict(loaded.state_dicts["policy"])
        if self.ref is not None and "ref" in loaded.state_dicts:
            self.ref.load_sharded_state_dict(loaded.state_dicts["ref"])
        st = loaded.loop_state
        self.prompts.load_state_dict(st.data_state)
        self.start_step, self.policy_version = st.step, st.policy_version
        served = self.policy
        if self.served is not None:
            if "served" in loaded.state_dicts:
                self.served.load_sharded_state_dict(loaded.state_dicts["served"])
            else:
                self.served.copy_weights_from(self.policy)
            served = self.served
        elif st.policy_version != st.step:
            log.warning("checkpoint.exact_resume=false: serving step %d's weights, not %d's",
                        st.step, st.policy_version)  # fmt: skip
            self.policy_version = st.step
        self.weight_sync.sync(served)
        _say(self.ctx, f"resumed from {latest} (step {st.step}, vLLM serves step "
             f"{self.policy_version})")  # fmt: skip

    def _install_signal_handlers(self) -> None:
        """SIGTERM / SIGUSR1 (Slurm's pre-emption warning) ask for a checkpoint and exit."""

        def handler(signum, frame):
            self.stop_requested = True

        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, handler)

    def _stop_agreed(self) -> bool:
        flag = torch.tensor([1.0 if self.stop_requested else 0.0])
        if self.ctx.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def log(self, step, version, rewards, reward_info, samples, adv, train, sync_report, t_step):
        from megatron_grpo.metrics import StepMetrics

        def mean(key):
            vals = [m[key] for m in train if key in m]
            return sum(vals) / len(vals) if vals else None

        lengths = [len(s.response_ids) for s in samples]
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        times = self.timer.times()
        task_scores = reward_info["task_scores"]
        extra = {k: v for k, v in reward_info.items() if k not in ("reward_mean", "task_scores")}
        extra.update({f"adv_{k}": v for k, v in adv.metrics.items()})
        extra.update(self._eval_metrics)  # validation of this step (eval.interval), if any
        self._eval_metrics = {}
        if "time_eval" in times:
            extra["time_eval"] = times["time_eval"]
        for key in ("ratio_mean", "ratio_min", "ratio_max", "pg_loss", "approx_kl"):
            if mean(key) is not None:
                extra[key] = mean(key)
        if sync_report is not None:
            extra.update(sync_seconds=sync_report.seconds, sync_minimal_bytes=sync_report.minimal_bytes,
                         sync_wire_bytes=sync_report.wire_bytes)  # fmt: skip
            extra.update({f"sync_{k}_s": v for k, v in sync_report.breakdown.items()})
            extra.update(getattr(self.weight_sync, "last_verify", None) or {})  # sync.verify
        row = StepMetrics(
            step=step,
            reward_mean=float(rewards.mean()), reward_std=float(rewards.std(unbiased=False)),
            pass_rate=sum(t >= 1.0 for t in task_scores) / len(task_scores),
            synced=sync_report is not None, policy_version=version, lag=step - 1 - version,
            sync_bytes=sync_report.bytes if sync_report is not None else 0,
            time_rollout=times.get("time_rollout"), time_reward=times.get("time_reward"),
            time_logprobs=times.get("time_logprobs"), time_train=times.get("time_train"),
            time_sync=times.get("time_sync", 0.0), time_step=t_step,
            response_len_mean=sum(lengths) / len(lengths), response_len_max=max(lengths),
            clip_frac_low=mean("clip_frac_low"), clip_frac_high=mean("clip_frac_high"),
            kl=mean("kl_ref"), entropy=mean("entropy"),
            masked_frac=float((~adv.keep).float().mean()), tokens_per_s=tokens / t_step,
            loss=mean("loss"), grad_norm=train[-1]["grad_norm"] if train else None,
            lr=train[-1]["lr"] if train else None,
            skipped_nan=any(m.get("skipped") for m in train),
            gpu_memory=self.memory.take_boundaries(), extra=extra,
        )  # fmt: skip
        self.logger.log(row)

    def finish(self) -> dict[str, Any]:
        summary = self.logger.finish(self.cfg.sync.interval)
        if self.ctx.rank == 0 and summary:
            from megatron_grpo.metrics.console import console_out

            print(summary, file=console_out(), flush=True)
        return {"preempted": False, "step": self.cfg.steps}

    def close(self) -> None:
        from megatron_grpo.distributed import destroy_distributed

        self.logger.close()
        self.reward_fn.close()
        self.engine.shutdown()
        destroy_distributed()


def train(cfg: Config, resume: bool = False) -> dict[str, Any]:
    """Build the run, train, and tear down (every process started here is stopped).

    ``rollout.placement=disaggregated``: the last ranks serve vLLM (``rollout.server.serve``,
    until trainer rank 0 says stop) and the others train."""
    world = None
    if cfg.rollout.placement == "disaggregated":
        from megatron_grpo.rollout.server import join_world, serve

        validate_world(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        world = join_world(cfg)
        if not world.is_trainer:
            return serve(cfg, world)
    try:
        trainer = GRPOTrainer(cfg, resume=resume, world=world)
    except BaseException as e:
        if world is not None:
            world.abort(f"trainer rank {world.rank} failed to start: {type(e).__name__}: {e}")
        raise
    try:
        return trainer.run()
    finally:
        trainer.close()
