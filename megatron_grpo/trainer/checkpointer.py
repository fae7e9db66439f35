"""When the loop saves, what a save holds, how a run resumes, and Slurm's pre-emption signal.

The loop asks one question after logging each step: ``Checkpointer.after_step(step,
state)`` (the ``LoopState``) saves when the step is due (``checkpoint.interval``, the last step with
``checkpoint.save_at_end``) and, when a pre-emption signal reached any rank (SIGTERM,
SIGUSR1: Slurm's warning), saves unless it just did and answers True: the run then exits 0
and ``--resume`` continues it.

A save holds the policy (weights + optimizer), pi_ref when the KL needs it, and, with
``checkpoint.exact_resume`` and v > 1, the *served* weights: vLLM serves pi_{version}, not
pi_step, inside a sync window, and a resume must push exactly those back into the engines
(``served``). The loop state records the step, the served version and the data position
of the consumed steps (``rollout.ahead`` may have drawn further).
"""

from __future__ import annotations

import logging
import signal
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_grpo.checkpoint import LoopState, find_intact, load_checkpoint, save_checkpoint
from megatron_grpo.config import ConfigError
from megatron_grpo.config.schema import CheckpointConfig
from megatron_grpo.distributed import ParallelContext
from megatron_grpo.metrics.console import say_rank0
from megatron_grpo.policy import Policy
from megatron_grpo.trainer.colocated_memory import ColocatedMemory
from megatron_grpo.trainer.watchdog import bounded_step

log = logging.getLogger("megatron_grpo.trainer")


class Preemption:
    """SIGTERM / SIGUSR1 (Slurm's pre-emption warning) ask the run to save and exit.

    Built first thing when a run is built: a warning during start-up (model load, engine
    start) must not kill the process before it can exit cleanly."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        self.requested = True

    def agreed(self, ctx: ParallelContext) -> bool:
        """True on every rank when any rank got the signal (collective over ``ctx``'s world)."""
        flag = torch.tensor([1.0 if self.requested else 0.0])
        if ctx.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class Checkpointer:
    """Saves and restores a run's state; exits on ``Preemption``.

    ``policy``, ``ref``, ``served``: the policy and its optional reference and served-weights
    copies (``policy.make_reference``); ``memory``: the colocated turns (the trainer's state
    is brought back to the GPU for a save)."""

    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig, total_steps: int,
                 ctx: ParallelContext, policy: Policy, ref: Policy | None,
                 served: Policy | None, memory: ColocatedMemory, timeout_s: float,
                 preemption: Preemption) -> None:  # fmt: skip
        self.run_dir, self.cfg, self.total_steps, self.ctx = Path(run_dir), cfg, total_steps, ctx
        self.policy, self.ref, self.served, self.memory = policy, ref, served, memory
        self.timeout_s, self.preemption = timeout_s, preemption
        self.last_saved = 0
        self.last_step = 0  # the last step the loop finished (restarts.py names the next)

    # ------------------------------------------------------------------------ the loop's
    def due(self, step: int) -> bool:
        c = self.cfg
        return bool(c.interval and step % c.interval == 0) or (
            c.save_at_end and step == self.total_steps
        )

    def after_step(self, step: int, state: LoopState) -> bool:
        """Save when due; on a pre-emption signal save (unless just saved) and return True.
        A step is finished (``last_step``) once its checkpoint, when due, is written: a
        failure during the write is a failure of that step (restarts.py names it)."""
        if self.due(step):
            with bounded_step(
                f"the checkpoint of step {step}", self.timeout_s, self.run_dir, self.ctx.rank, step
            ):
                self.save(state)
        self.last_step = step
        if not self.stop_agreed():
            return False
        if self.last_saved != step:
            self.save(state)
        say_rank0(self.ctx, f"preemption signal: checkpoint at step {step} saved, exiting")
        return True

    def stop_agreed(self) -> bool:
        """True on every rank when any rank got a pre-emption signal (collective)."""
        return self.preemption.agreed(self.ctx)

    def snapshot_served(self, pushed: Policy) -> None:
        """After a sync of ``pushed``: the served copy follows it (exact resume inside a
        window); a push of the served copy itself (a resume) leaves it as it is."""
        if self.served is not None and pushed is not self.served:
            self.served.copy_weights_from(pushed)

    # ------------------------------------------------------------------------ save / load
    def _state_dicts(self, for_loading: bool = False) -> dict[str, Any]:
        parts: dict[str, Any] = {"policy": partial(self.policy.sharded_state_dict, for_loading)}
        if self.ref is not None:
            parts["ref"] = lambda: self.ref.sharded_state_dict()
        if self.served is not None:
            parts["served"] = lambda: self.served.sharded_state_dict()
        return parts

    def save(self, state: LoopState) -> None:
        parts = self._state_dicts()
        if self.served is not None and state.policy_version == state.step:
            parts.pop("served")  # the served weights are the policy's own
        with self.memory.trainer_resident():
            path = save_checkpoint(self.run_dir, state, parts, keep_last=self.cfg.keep_last)
        self.last_saved = state.step
        say_rank0(self.ctx, f"checkpoint {path}")

    def resume(self) -> tuple[LoopState, Policy]:
        """Load the newest intact checkpoint into the policy (and ref, served); returns its
        loop state and the module whose weights vLLM must serve again (without a served
        copy, ``checkpoint.exact_resume=false``, the checkpoint step's own weights)."""
        t0 = time.perf_counter()
        latest, damaged = find_intact(self.run_dir)
        for reason in damaged:
            say_rank0(self.ctx, f"{reason.split(';')[0]}: skipping it")
        if latest is None:
            raise ConfigError(
                f"--resume: no intact checkpoint under {self.run_dir}/checkpoints; start "
                "without --resume, or point --run-dir at the run to continue."
            )
        if damaged:
            say_rank0(self.ctx, f"falling back to the newest intact checkpoint, {latest.name}")
        templates = {k: v() for k, v in self._state_dicts(for_loading=True).items()}
        loaded = load_checkpoint(latest, templates, optional=("ref", "served"), verify=False)
        self.policy.load_sharded_state_dict(loaded.state_dicts["policy"])
        if self.ref is not None and "ref" in loaded.state_dicts:
            self.ref.load_sharded_state_dict(loaded.state_dicts["ref"])
        st = loaded.loop_state
        self.last_saved = self.last_step = st.step
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
            st.policy_version = st.step
        say_rank0(
            self.ctx,
            f"resumed from {latest} (step {st.step}, vLLM serves step {st.policy_version}) in "
            f"{time.perf_counter() - t0:.1f}s",
        )
        return st, served


def loop_state_of(trainer: Any, step: int) -> LoopState:
    """What a save after step ``step`` records of the loop (a ``GRPOTrainer``): the served
    version, the data position of the consumed steps (not the prefetched), the layout."""
    version, ctx = trainer.policy_version, trainer.ctx
    return LoopState(
        step=step, policy_version=version, sync_phase=step - version,
        data_state=trainer.window.data_state(),
        extra={"layout": {"tp": ctx.tp, "cp": ctx.cp, "pp": ctx.pp, "dp": ctx.dp},
               "weight_syncs": trainer.sender.syncs,
               # the schedule's state is policy_version; kept to show which mode ran
               "sync_schedule": {"mode": trainer.schedule.mode}},
    )  # fmt: skip
