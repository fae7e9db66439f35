"""A step's rewards ``[P, G]`` from its samples: decode, the reward function, DAPO shaping.

Kept out of the package's ``__init__`` (it imports torch; the reward pool's workers import
``megatron_grpo.rewards`` and must start quickly).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_grpo.algorithms.shaping import shape_rewards


def env_scored(samples: Sequence[Any], scores: Sequence[float]) -> list[float]:
    """``scores`` with each multi-turn episode's environment reward in place of its score,
    where the environment gave one (``Sample.env_reward``): training, validation and eval
    score episodes this one way."""
    return [sc if s.env_reward is None else s.env_reward for s, sc in zip(samples, scores)]


class GroupScorer:
    """``scorer(prompts, samples) -> (rewards [P, G], info)``; ``info`` is the reward
    function's (``task_scores`` among it). Responses are decoded without special tokens;
    with ``grpo.overlong_buffer > 0`` DAPO's overlong penalty is added. A multi-turn
    episode's reward is its environment's (``Sample.env_reward``) where it gave one, and the
    reward function scores only the others (their whole transcript), so its counters
    (``errors``, ``timeouts``) and ``format_mean`` cover those."""

    def __init__(self, reward_fn: Any, tokenizer: Any, group_size: int, max_new_tokens: int,
                 overlong_buffer: int, overlong_penalty: float) -> None:  # fmt: skip
        self.reward_fn, self.tokenizer, self.group_size = reward_fn, tokenizer, group_size
        self.max_new_tokens = max_new_tokens
        self.overlong_buffer, self.overlong_penalty = overlong_buffer, overlong_penalty

    @classmethod
    def from_config(cls, cfg: Any, reward_fn: Any, tokenizer: Any) -> GroupScorer:
        g = cfg.grpo
        return cls(reward_fn, tokenizer, g.group_size, cfg.rollout.max_new_tokens,
                   g.overlong_buffer, g.overlong_penalty)  # fmt: skip

    def __call__(self, prompts: list, samples: list) -> tuple[torch.Tensor, dict[str, Any]]:
        g = self.group_size
        texts = self.tokenizer.batch_decode(
            [s.response_ids for s in samples], skip_special_tokens=True
        )
        # The reward function scores what no environment did (every response without env.name).
        todo = [i for i, s in enumerate(samples) if s.env_reward is None]
        scored, info = self.reward_fn(
            [prompts[i // g].text for i in todo],
            [texts[i] for i in todo],
            [prompts[i // g].answer for i in todo],
            rows=[prompts[i // g].row for i in todo],  # a remote reward's extras
        )
        if len(todo) == len(samples):
            rewards = scored
        else:  # episodes the environment scored keep its reward
            rewards = env_scored(samples, [0.0] * len(samples))
            task = list(rewards)
            for j, i in enumerate(todo):
                rewards[i], task[i] = scored[j], info["task_scores"][j]
            info = {**info, "task_scores": task, "reward_mean": sum(rewards) / len(rewards),
                    "task_mean": sum(task) / len(rewards)}  # fmt: skip
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        rewards_PG = torch.tensor(rewards, dtype=torch.float32).view(len(prompts), g)
        shaped = shape_rewards(
            rewards_PG, lengths, self.max_new_tokens, self.overlong_buffer, self.overlong_penalty
        )
        return shaped, info
