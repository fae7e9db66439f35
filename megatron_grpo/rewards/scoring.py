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
    episode's reward is its environment's (``Sample.env_reward``) where it gave one; the
    reward function scores the whole transcript otherwise."""

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
        rewards, info = self.reward_fn(
            [prompts[i // g].text for i in range(len(samples))],
            texts,
            [prompts[i // g].answer for i in range(len(samples))],
            rows=[prompts[i // g].row for i in range(len(samples))],  # a remote reward's extras
        )
        if any(s.env_reward is not None for s in samples):  # episodes the environment scored
            rewards = env_scored(samples, rewards)
            info = {**info, "task_scores": env_scored(samples, info["task_scores"])}
            info["reward_mean"] = sum(rewards) / len(rewards)
            info["task_mean"] = sum(info["task_scores"]) / len(rewards)
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        rewards_PG = torch.tensor(rewards, dtype=torch.float32).view(len(prompts), g)
        shaped = shape_rewards(
            rewards_PG, lengths, self.max_new_tokens, self.overlong_buffer, self.overlong_penalty
        )
        return shaped, info
