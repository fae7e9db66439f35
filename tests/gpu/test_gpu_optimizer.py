"""torch's fused AdamW under megatron's optimizer on CUDA (``optim.fused_adam=auto``,
policy/optimizer.py ``set_fused_adam``; the CPU side is tests/policy/test_fused_adam.py)."""

from __future__ import annotations

import pytest

from tests.gpu.conftest import needs_cuda
from tests.helpers.steps import preset_policy, suite_batch, suite_loss


def test_fused_adam_is_in_use_on_cuda(ctx, figures):
    """Every ``auto`` at its CUDA value: megatron's DistributedOptimizer steps its fp32 main
    params with torch's fused AdamW (``_fused_adamw_`` dispatched, ``step`` counters on the
    GPU), or with Transformer-Engine's/Apex's FusedAdam where installed; against
    ``fused_adam=off`` (torch's foreach) one step from the same weights differs in rounding
    only."""
    needs_cuda()
    from megatron_grpo.bench.ops.count import OpCounter
    from megatron_grpo.policy.optimizer import torch_adams

    spec, on = preset_policy(ctx, "tiny", "bfloat16")
    adams = torch_adams(on.optimizer)
    if not adams:  # megatron found TE or Apex: their FusedAdam, not torch's
        inner = on.optimizer.chained_optimizers[0].optimizer
        assert "FusedAdam" in type(inner).__name__, type(inner)
        pytest.skip(f"megatron runs {type(inner).__module__}.FusedAdam (fused already)")
    assert type(on.optimizer.chained_optimizers[0]).__name__ == "DistributedOptimizer"
    assert {g["fused"] for o in adams for g in o.param_groups} == {True}
    _, off = preset_policy(ctx, "tiny", "bfloat16", fused_adam="off")
    off.copy_weights_from(on)
    batch, counts = suite_batch(spec.vocab_size), {}
    for name, policy in (("fused", on), ("foreach", off)):
        ops = OpCounter(sites=False)
        with ops:
            policy.train_step(batch, suite_loss, micro_batch_size=4)
        counts[name] = ops.counts.by_name
        figures[f"adam_{name}_train_step_aten_ops"] = sum(ops.counts.by_name.values())
    assert counts["fused"].get("_fused_adamw_", 0) >= 1, counts["fused"]
    assert "_fused_adamw_" not in counts["foreach"] and "_foreach_addcdiv_" in counts["foreach"]
    assert all(st["step"].is_cuda for o in adams for st in o.state.values())
    main = [[p for g in pol.optimizer.param_groups for p in g["params"]] for pol in (on, off)]
    worst = max((a - b).abs().max().item() for a, b in zip(*main, strict=True))
    figures["fused_adam_max_main_param_diff_vs_foreach"] = worst
    # Adam's first step moves a weight by lr * g / (|g| + eps), about +-lr (1e-3 here): the
    # two agree to a few fp32 ulps (tests/policy/test_fused_adam.py), or differ by 2 lr where a
    # gradient within rounding of zero changed sign between the two backward passes.
    assert worst <= 2e-3 + 1e-6
