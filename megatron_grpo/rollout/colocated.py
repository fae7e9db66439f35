"""Colocated placement: every trainer rank hosts one TP rank of a vLLM engine in-process.

Engine ``e`` is global ranks ``[e*t, (e+1)*t)`` for rollout TP ``t`` (vLLM's
``external_launcher``). A step's P prompts are split in contiguous shares, engine ``e``
sampling prompts ``[e*P//E, (e+1)*P//E)`` (``engine_slice``), and the shares are gathered
on every rank, prompt-major, so every rank holds the whole batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from megatron_grpo.bridge.transfer_group import PlanInputs
from megatron_grpo.bridge.weight_sync import WeightSender, colocated_sender
from megatron_grpo.distributed.placement import colocated_engines
from megatron_grpo.rollout.agent import StepPrompts, agent_loop
from megatron_grpo.rollout.engine import RolloutEngine


def engine_slice(num_prompts: int, engines: int, e: int) -> slice:
    """Engine ``e``'s share of a step's prompts."""
    return slice(e * num_prompts // engines, (e + 1) * num_prompts // engines)


class ColocatedRollout:
    """The in-process engines behind the rollout interface (``rollout.interface.Rollout``)."""

    def __init__(self, engine: Any, ctx: Any, rollout_tp: int, agent: Any = None) -> None:
        self.engine, self.ctx, self.rollout_tp = engine, ctx, rollout_tp
        self.agent = agent
        """``rollout.agent.AgentLoop`` with ``env.name``: episodes instead of one turn."""

    def launch(self, steps: list[StepPrompts], **sampling: Any) -> list[Callable[[], list | None]]:
        """One ``generate`` call for all ``steps`` (``[(prompt_ids, seed[, rows])]``) on every
        engine: engine ``e`` samples its share of each step's prompts, each request seeded
        as the step's own call would seed it (``seed + i*n`` for its i-th prompt); the shares
        are gathered on every rank. Returns one thunk per step yielding its samples."""
        return [functools.partial(list, s) for s in self._per_step(steps, **sampling)]

    def _per_step(self, steps: list[StepPrompts], **sampling: Any) -> list[list]:
        """Each step's samples (``launch``), gathered from every engine."""
        ctx, tp, n = self.ctx, self.rollout_tp, sampling["n"]
        engines, e = ctx.world_size // tp, ctx.rank // tp
        ids: list = []
        seeds: list[int] = []
        rows: list = []
        for prompt_ids, seed, *step_rows in steps:
            share = engine_slice(len(prompt_ids), engines, e)
            mine = prompt_ids[share]
            ids += mine
            seeds += [seed + i * n for i in range(len(mine))]
            rows += step_rows[0][share] if step_rows else [None] * len(mine)
        if self.agent is not None:
            samples = self.agent.generate(self.engine, ids, rows, seeds=seeds, **sampling)
        else:
            samples = self.engine.generate(ids, seeds=seeds, **sampling)
        everyone: list = [samples]
        if ctx.world_size > 1:
            everyone = [None] * ctx.world_size
            dist.all_gather_object(everyone, samples)
        per_step: list[list] = [[] for _ in steps]
        for k in range(engines):
            theirs, at = everyone[k * tp], 0
            for j, (prompt_ids, *_) in enumerate(steps):
                sl = engine_slice(len(prompt_ids), engines, k)
                count = (sl.stop - sl.start) * n
                per_step[j] += theirs[at : at + count]
                at += count
        # prompt-major over the whole step: engine 0's share, then engine 1's, ...
        return per_step

    @staticmethod
    def share(fn: Callable[[], Any]) -> Any:
        """Every rank holds every sample (gathered in ``launch``): ``fn()`` here."""
        return fn()

    def generate(self, prompt_ids: list, seed: int, rows: list | None = None,
                 **sampling: Any) -> list:  # fmt: skip
        """All prompts' samples, prompt-major, on every rank (one step's ``launch``)."""
        step: StepPrompts = (prompt_ids, seed) if rows is None else (prompt_ids, seed, rows)
        return self._per_step([step], **sampling)[0]

    def shutdown(self) -> None:
        self.engine.shutdown()


def build_colocated(
    hf_dir, spec, ctx, cfg, policy, **engine_kwargs
) -> tuple[ColocatedRollout, WeightSender]:
    """This rank's vLLM engine (serving ``hf_dir``; ``engine_kwargs`` go to
    ``RolloutEngine``) and the resharding bridge that feeds it ``policy``'s shards. Shared
    by training and ``megatron-grpo eval`` (evaluation/evaluate.py)."""
    engine = RolloutEngine.from_config(hf_dir, cfg.rollout, **engine_kwargs)
    agent = agent_loop(cfg, hf_dir)
    engines = colocated_engines(ctx.world_size, cfg.rollout.tp)
    inputs = PlanInputs.of(
        hf_dir, ctx, policy, cfg.sync, cfg.rollout.tp, engines, cfg.rollout.expert_parallel
    )
    sender = colocated_sender(inputs, spec, ctx, engine, cfg.sync)
    return ColocatedRollout(engine, ctx, cfg.rollout.tp, agent), sender
