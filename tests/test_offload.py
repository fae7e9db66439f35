"""Trainer offload for real on CPU: optimizer state, fp32 masters and gradient buffers leave
their storages (0 bytes on the device side), come back, and training continues bit for bit
as if nothing had moved (two optimizer steps compared with a twin policy that never
offloads)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_policy import _batch, reinforce_loss


def _worker(rank, world_size, hf_dir, dtype, params):
    from megatron_grpo.config.schema import ModelConfig, OptimConfig, ParallelConfig
    from megatron_grpo.distributed import destroy_distributed, init_distributed
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.policy import build_policy
    from megatron_grpo.policy.offload import TrainerOffload

    spec = load_spec(hf_dir)
    ctx = init_distributed(ParallelConfig(), spec, seed=3)
    try:
        mcfg, ocfg = ModelConfig(dtype=dtype), OptimConfig(lr=1e-2, clip_grad=1.0)
        a = build_policy(spec, ctx, mcfg, ocfg)
        b = build_policy(spec, ctx, mcfg, ocfg)
        b.copy_weights_from(a)
        batch = _batch(spec.vocab_size)
        loss_fn = partial(reinforce_loss, n_tokens=float(batch["loss_mask"].sum()))
        off = TrainerOffload(a, params=params)
        out = {"freed": [], "reloaded": []}
        for _ in range(2):
            ma = a.train_step(batch, loss_fn, micro_batch_size=2)
            mb = b.train_step(batch, loss_fn, micro_batch_size=2)
            out.setdefault("loss_equal", []).append(ma["loss"] == mb["loss"])
            state = [
                v
                for s in a.optimizer.optimizer.state.values()
                for v in s.values()
                if isinstance(v, torch.Tensor) and v.numel() > 1
            ]
            before = [v.clone() for v in state]
            rep = off.offload()
            out["freed"].append(rep.bytes)
            out["state_empty"] = all(v.untyped_storage().nbytes() == 0 for v in state)
            out["grads_empty"] = all(
                buf.grad_data.untyped_storage().nbytes() == 0 for buf in a.chunks[0].buffers
            )
            out["params_empty"] = all(
                p.untyped_storage().nbytes() == 0 for p in a.chunks[0].parameters()
            )
            out["reloaded"].append(off.reload().bytes)
            out["state_back"] = all(torch.equal(x, y) for x, y in zip(before, state))
        out["weights_equal"] = all(
            torch.equal(x, y)
            for (_, x), (_, y) in zip(a.named_shards(), b.named_shards(), strict=True)
        )
        out["n_state_bytes"] = sum(v.untyped_storage().nbytes() for v in state)
        out["grad_bytes"] = sum(
            buf.grad_data.untyped_storage().nbytes() for buf in a.chunks[0].buffers
        )
        return out
    finally:
        destroy_distributed()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("params", [False, True])
def test_offload_reload_trains_bit_for_bit(tiny_dir, params):
    (r,) = run_distributed(_worker, 1, tiny_dir, "float32", params, timeout=160)
    assert r["loss_equal"] == [True, True]
    assert r["weights_equal"], "training after offload/reload must match the twin exactly"
    assert r["state_empty"] and r["grads_empty"] and r["state_back"]
    assert r["params_empty"] is params
    # Adam moments (2 x fp32 per weight) and the fp32 gradient buffer left the storage.
    assert r["freed"][1] >= r["n_state_bytes"] + r["grad_bytes"] > 0
    assert r["reloaded"] == r["freed"]
