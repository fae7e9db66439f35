"""Verifiable rewards: GSM8K, MATH (math_verify), synthetic tasks, user functions.

Entry point: :func:`build_reward` -> :class:`RewardFn`. This package imports no torch, so its
pool workers start quickly.
"""

from megatron_grpo.rewards.builder import RewardFn, build_reward, check_reward

__all__ = ["RewardFn", "build_reward", "check_reward"]
