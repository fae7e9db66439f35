"""Validation during training (``eval.interval``): pass@1 on held-out prompts.

Every ``eval.interval`` steps, after that step's sync, the engines already up generate
``eval.samples`` responses to the same ``eval.num_prompts`` held-out prompts (the ``test``
split of a ``synthetic:<task>`` source, or ``eval.data``); the run's reward scores them and
pass@1 (Chen et al. 2021, eq. 1, with k = 1: the fraction of correct samples, a task score
>= 1 as in ``megatron-grpo eval``) goes into that step's metrics row as ``eval_pass@1``,
with ``eval_policy_version``, the weights vLLM served. The prompts and the sampling seed are
fixed, so the figure moves only with the weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from megatron_grpo.algorithms.seeds import validation_seed
from megatron_grpo.config import Config
from megatron_grpo.data import build_prompt_source
from megatron_grpo.metrics.pass_at_k import mean_pass_at_k
from megatron_grpo.rewards.builder import RewardFn
from megatron_grpo.rewards.scoring import env_scored
from megatron_grpo.rollout.interface import sampling_args


class Validator:
    """Holds the held-out prompts; ``run(generate, policy_version)`` returns the metrics."""

    def __init__(self, cfg: Config, tokenizer: Any, reward_fn: RewardFn) -> None:
        e = cfg.eval
        data = (
            dataclasses.replace(cfg.data, source=e.data, split="train")
            if e.data
            else (dataclasses.replace(cfg.data, split="test"))
        )
        source = build_prompt_source(data, tokenizer)
        self.prompts = [source.next_batch(1)[0] for _ in range(min(e.num_prompts, len(source)))]
        self.cfg, self.tokenizer, self.reward_fn = cfg, tokenizer, reward_fn

    def due(self, step: int) -> bool:
        return bool(self.cfg.eval.interval) and step % self.cfg.eval.interval == 0

    def run(self, generate: Callable[..., list[Any]], policy_version: int) -> dict[str, Any]:
        e, r, k = self.cfg.eval, self.cfg.rollout, self.cfg.eval.samples
        rows = [p.row for p in self.prompts] if self.cfg.env.multi_turn else None
        samples = generate(
            [p.prompt_ids for p in self.prompts],
            seed=validation_seed(r.seed),
            rows=rows,
            **sampling_args(r, k, self.tokenizer.eos_token_id, temperature=e.temperature),
        )
        texts = self.tokenizer.batch_decode(
            [s.response_ids for s in samples], skip_special_tokens=True
        )
        _, info = self.reward_fn(
            [self.prompts[i // k].text for i in range(len(samples))],
            texts,
            [self.prompts[i // k].answer for i in range(len(samples))],
            rows=[self.prompts[i // k].row for i in range(len(samples))],  # a remote reward's
        )
        scores = env_scored(samples, info["task_scores"])
        correct = [t >= 1.0 for t in scores]
        correct_PK = [correct[i * k : (i + 1) * k] for i in range(len(self.prompts))]
        return {"eval_pass@1": mean_pass_at_k(correct_PK, 1), "eval_policy_version": policy_version}
