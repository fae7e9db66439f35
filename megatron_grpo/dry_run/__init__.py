"""The GPU-free dry run of a launch (``megatron-grpo plan``).

``build_launch_plan`` takes a config, a cluster shape (nodes x GPUs per node) and a model
shape (``models.shapes.resolve_spec``), and checks everything that can be checked before
GPUs are spent: parallel sizes against the world size and the model, which global ranks
train and which serve vLLM (``distributed.placement``), an estimate of memory per GPU
(``memory``), and the bytes the resharding bridge moves per weight sync (its static plan,
``bridge.plan``). Impossible plans raise ``PlanError`` naming the values and the fix.
"""

from megatron_grpo.dry_run.launch import LaunchPlan, PlanError, build_launch_plan

__all__ = ["LaunchPlan", "PlanError", "build_launch_plan"]
