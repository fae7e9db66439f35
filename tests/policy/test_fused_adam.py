"""torch's fused AdamW under megatron's optimizer (``optim.fused_adam``, policy/optimizer.py
``set_fused_adam``) and the foreach gradient norm and clipping, on the plain optimizer
(bf16 model, fp32 main params) and the DistributedOptimizer:

- the fused kernel is the one that steps (``_fused_adamw_`` dispatched, the per-parameter
  loop's ops gone), and the gradient norm and clipping are the foreach ones on both;
- fused and unfused give the same fp32 main params after a few steps up to rounding: the
  two compute the same AdamW update with their operations in a different order (the loop:
  ``sqrt(v) / sqrt(1 - b2^t) + eps``, then ``addcdiv``; the kernel: one fused expression in
  registers), so a step differs by a few fp32 ulps of the update and, once a weight's
  rounding flips, by one ulp of the weight. The bound below is 4 ulps of the largest weight.

Resume with the fused optimizer, bit for bit, is tests/e2e/test_gpu_config.py (it runs the GPU
configuration, ``optim.fused_adam`` included); on CUDA,
tests/gpu/test_gpu_optimizer.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.config.schema import ConfigError, ModelConfig, OptimConfig, ParallelConfig
from tests.dist_utils import run_distributed
from tests.helpers.steps import adv_loss, gpu_batch

STEPS = 3


def _train(hf_dir, ctx, dist_opt: str, fused: str) -> dict:
    from functools import partial

    from megatron_grpo.bench.ops.count import OpCounter
    from megatron_grpo.layouts.io import load_hf_into_megatron
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.policy import build_policy
    from megatron_grpo.policy.optimizer import torch_adams

    spec = load_spec(hf_dir)
    init = partial(load_hf_into_megatron, hf_dir=hf_dir, spec=spec, ctx=ctx)
    # clip_grad far below the gradient norm: every step clips (multi_tensor_scale runs).
    optim = OptimConfig(lr=1e-3, weight_decay=0.01, clip_grad=1e-3,
                        distributed_optimizer=dist_opt, fused_adam=fused)  # fmt: skip
    policy = build_policy(spec, ctx, ModelConfig(dtype="bfloat16"), optim, init_weights=init)
    for k in range(STEPS - 1):
        policy.train_step(gpu_batch(policy.vocab_size, seed=k), adv_loss, micro_batch_size=2)
    batch, ops = gpu_batch(policy.vocab_size, seed=STEPS), OpCounter(sites=False)
    with ops:
        m = policy.train_step(batch, adv_loss, micro_batch_size=2)
    adams = torch_adams(policy.optimizer)
    return {
        "optimizer": type(policy.optimizer.chained_optimizers[0]).__name__,
        "fused_flags": sorted({str(g["fused"]) for o in adams for g in o.param_groups}),
        "ops": dict(ops.counts.by_name),
        "grad_norm": m["grad_norm"],
        "main": [p.detach().clone() for g in policy.optimizer.param_groups for p in g["params"]],
    }


def _parity_worker(rank, world, hf_dir):
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.models.spec import load_spec

    with distributed_context(ParallelConfig(), load_spec(hf_dir), seed=11) as ctx:
        out = {}
        for dist_opt in ("off", "on"):
            runs = {f: _train(hf_dir, ctx, dist_opt, f) for f in ("off", "on")}
            a, b = runs["off"]["main"], runs["on"]["main"]
            out[dist_opt] = {
                **{f: {k: v for k, v in r.items() if k != "main"} for f, r in runs.items()},
                "max_diff": max((x - y).abs().max().item() for x, y in zip(a, b, strict=True)),
                "max_weight": max(x.abs().max().item() for x in a),
                "bitwise": all(torch.equal(x, y) for x, y in zip(a, b)),
            }
        return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fused_adam_steps_like_torch_loop_on_plain_and_distributed_optimizer(tiny_dir):
    [res] = run_distributed(_parity_worker, 1, tiny_dir, timeout=220)
    for dist_opt, want in (("off", "Float16OptimizerWithFloat16Params"),
                           ("on", "DistributedOptimizer")):  # fmt: skip
        r = res[dist_opt]
        off, on = r["off"], r["on"]
        assert off["optimizer"] == on["optimizer"] == want, r
        assert on["fused_flags"] == ["True"] and off["fused_flags"] == ["None"], r
        # one kernel per param group (megatron's: with and without weight decay)
        assert on["ops"].get("_fused_adamw_") == 2 and "_fused_adamw_" not in off["ops"], r
        assert "addcdiv_" in off["ops"] and "addcdiv_" not in on["ops"], r  # the loop's update
        for f in (off, on):  # foreach grad norm and clipping (use_foreach_grad_norm)
            assert f["ops"].get("_foreach_norm") == 1 and f["ops"].get("_foreach_mul_") == 1, r
            assert "linalg_vector_norm" in f["ops"] and f["grad_norm"] > 1e-3, r
        # the same update up to rounding (module doc): 4 fp32 ulps of the largest weight
        assert 0 < r["max_diff"] <= 4 * torch.finfo(torch.float32).eps * r["max_weight"], r
        assert on["grad_norm"] == pytest.approx(off["grad_norm"], rel=1e-3), r


def test_fused_adam_key_is_validated():
    assert OptimConfig(fused_adam=True).fused_adam == "on"  # YAML 1.1's bare on
    assert OptimConfig(fused_adam=False).fused_adam == "off"
    with pytest.raises(ConfigError) as e:
        OptimConfig(fused_adam="yes")
    assert str(e.value) == (
        "optim.fused_adam='yes' is not one of ['auto', 'on', 'off']: "
        "set optim.fused_adam to one of them."
    )


def test_use_fused_adam_auto_is_on_with_cuda_only():
    from megatron_grpo.policy.optimizer import use_fused_adam

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert use_fused_adam(OptimConfig(), cuda) and not use_fused_adam(OptimConfig(), cpu)
    assert use_fused_adam(OptimConfig(fused_adam="on"), cpu)
    assert not use_fused_adam(OptimConfig(fused_adam="off"), cuda)


def test_set_fused_adam_holds_after_loading_a_state_of_the_other_setting():
    """torch's ``load_state_dict`` restores the saved groups' ``fused`` flags; the checkpoint
    load calls ``set_fused_adam`` again (policy/checkpoint_state.py), which keeps the step."""
    from types import SimpleNamespace

    from megatron_grpo.bench.ops.count import OpCounter
    from megatron_grpo.policy.optimizer import set_fused_adam

    def adam():
        p = torch.nn.Parameter(torch.ones(3))
        return p, torch.optim.AdamW([p], lr=0.1)

    p, a = adam()
    p.grad = torch.ones(3)
    a.step()
    q, b = adam()
    wrapped = SimpleNamespace(optimizer=b)  # megatron's optimizers hold torch's as .optimizer
    assert set_fused_adam(wrapped, True) and b.defaults["fused"] is True
    b.load_state_dict(a.state_dict())  # saved unfused
    assert b.param_groups[0]["fused"] is None
    assert set_fused_adam(wrapped, True) and b.param_groups[0]["fused"] is True
    assert b.state[q]["step"].item() == 1.0 and b.state[q]["step"].dtype == torch.float32
    q.grad = torch.ones(3)
    ops = OpCounter(sites=False)
    with ops:
        b.step()
    assert ops.counts.by_name["_fused_adamw_"] == 1 and b.state[q]["step"].item() == 2.0
    assert not set_fused_adam(wrapped, False) and b.param_groups[0]["fused"] is None
    assert not set_fused_adam(SimpleNamespace(optimizer=None), True)  # TE/Apex: theirs
