"""``model.recompute=full``: megatron recomputes every layer in the backward pass; the step
is the same computation, so log-probs, gradients and the updated weights match the run
without it (no dropout: the recomputed forward is the same forward)."""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.config.schema import ParallelConfig
from tests.dist_utils import run_distributed


def _worker(rank, world, hf_dir, dtype):
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.models.spec import load_spec
    from tests.helpers.steps import adv_loss, build_policy_at, gpu_batch

    spec = load_spec(hf_dir)
    with distributed_context(ParallelConfig(), spec, seed=5) as ctx:
        out = {}
        for mode in ("none", "full"):
            p = build_policy_at(hf_dir, ctx, dtype, "off", recompute=mode)
            batch = gpu_batch(spec.vocab_size, seed=3)
            m = p.train_step(batch, adv_loss, micro_batch_size=2, token_budget=24)
            grads = {n: q.main_grad.clone() for n, q in p.models[0].named_parameters()}
            out[mode] = (m["loss"], m["grad_norm"], grads, dict(p.named_shards()))
            out[mode + "_config"] = p.config.recompute_granularity
        return out


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_full_recompute_is_the_same_step(tiny_dir, dtype):
    [r] = run_distributed(_worker, 1, tiny_dir, dtype, timeout=180)
    assert r["none_config"] is None and r["full_config"] == "full"
    (la, ga, grads_a, wa), (lb, gb, grads_b, wb) = r["none"], r["full"]
    assert la == lb and ga == gb
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
