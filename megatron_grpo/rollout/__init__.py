"""Rollout: vLLM engines that sample GRPO groups, colocated (external_launcher) or standalone."""

from megatron_grpo.rollout.engine import RolloutEngine
from megatron_grpo.rollout.samples import Sample

__all__ = ["RolloutEngine", "Sample"]
