"""``model.recompute=full``: megatron recomputes every layer in the backward pass; the step
is the same computation, so log-probs, gradients and the updated weights match the run
without it (no dropout: the recomputed forward is the same forward)."""

from __future__ import annotations

import gc

import pytest
import torch

from megatron_grpo.config.schema import ParallelConfig
from tests.dist_utils import run_distributed


def _worker(rank, world, hf_dir, dtype, tp):  # world: tp x pp
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.models.spec import load_spec
    from tests.helpers.steps import adv_loss, build_policy_at, gpu_batch

    spec = load_spec(hf_dir)
    with distributed_context(ParallelConfig(tp=tp, pp=world // tp), spec, seed=5) as ctx:
        out = {}
        for mode in ("none", "full"):
            p = build_policy_at(hf_dir, ctx, dtype, "off", recompute=mode)
            batch = gpu_batch(spec.vocab_size, seed=3)
            m = p.train_step(batch, adv_loss, micro_batch_size=2, token_budget=24)
            grads = {n: q.main_grad.clone() for n, q in p.models[0].named_parameters()}
            out[mode] = (m["loss"], m["grad_norm"], grads, dict(p.named_shards()))
            out[mode + "_checkpointed"] = sum(
                type(mod).__name__.startswith("Checkpointed") for mod in p.models[0].modules()
            )
            out["layers"] = spec.num_layers // (world // tp)  # this stage's
        return out


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "dtype, tp, pp", [("float32", 1, 1), ("bfloat16", 1, 1), ("float32", 2, 1), ("float32", 1, 2)]
)
def test_full_recompute_is_the_same_step(tiny_dir, dtype, tp, pp):
    """tp=2: the recompute re-runs the layer's TP collectives before fc2 on both ranks;
    pp=2: each stage checkpoints its own layer under the pipeline schedule."""
    for r in run_distributed(_worker, tp * pp, tiny_dir, dtype, tp, timeout=180):
        assert r["none_checkpointed"] == 0 and r["full_checkpointed"] == r["layers"]
        (la, ga, grads_a, wa), (lb, gb, grads_b, wb) = r["none"], r["full"]
        assert la == lb and ga == gb
        assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
        assert all(torch.equal(wa[n], wb[n]) for n in wa)


def _live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor the interpreter holds."""
    seen: dict[int, int] = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            s = o.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _retained_worker(rank, world, hf_dir):
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.models.spec import load_spec
    from tests.helpers.steps import adv_loss, build_policy_at, gpu_batch

    spec = load_spec(hf_dir)
    live = {}
    with distributed_context(ParallelConfig(), spec, seed=5) as ctx:
        batch = gpu_batch(spec.vocab_size, seed=3)
        for mode in ("none", "full"):
            p = build_policy_at(hf_dir, ctx, "bfloat16", "off", recompute=mode)
            p.train_step(batch, adv_loss, micro_batch_size=2, token_budget=24)
            gc.collect()
            live[mode] = _live_tensor_bytes()
            del p
            gc.collect()
    return live


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_full_recompute_keeps_nothing_of_the_step(tiny_dir):
    """After a step, the recomputed policy holds the same tensors as the plain one: nothing of
    the step's graph. Megatron's TransformerLayer keeps its mid-layer hidden state
    (``mlp_norm_manager``) until the next forward; under the non-reentrant checkpoint that
    tensor's graph held every layer's checkpoint frame, recomputed tensors included, until
    the next step: 9.2 GiB of a 16k-token Qwen2.5-1.5B step on an H200 (37.1 GiB peak against
    30.6 with megatron's recompute; docs/benchmarks.md section 6)."""
    (live,) = run_distributed(_retained_worker, 1, tiny_dir, timeout=100)
    assert live["full"] == live["none"], live
