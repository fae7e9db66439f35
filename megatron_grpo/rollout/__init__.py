"""Rollout: vLLM engines that sample GRPO groups, colocated (external_launcher) or standalone."""

from megatron_grpo.rollout.engine import RolloutEngine, Sample

__all__ = ["RolloutEngine", "Sample"]
