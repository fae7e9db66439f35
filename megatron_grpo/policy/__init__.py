"""The trainer's policy: megatron-core model chunks (``model_builder``), vocab-parallel
log-probs/entropy, forward-only log-probs through megatron's pipeline schedule, and the
train step (DDP + megatron optimizer)."""

from megatron_grpo.policy.logprob import token_logprobs, vocab_parallel_logprob_entropy
from megatron_grpo.policy.lr_schedule import LRSchedule
from megatron_grpo.policy.policy import Policy, build_policy

__all__ = [
    "LRSchedule",
    "Policy",
    "build_policy",
    "token_logprobs",
    "vocab_parallel_logprob_entropy",
]
