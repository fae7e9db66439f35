"""megatron-grpo: off-policy GRPO on Megatron-core with a TP/PP -> vLLM resharding bridge."""

__version__ = "0.1.0"
