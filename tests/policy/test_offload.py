"""Trainer offload for real on CPU: optimizer state, fp32 masters and gradient buffers leave
their storages (0 bytes on the device side), come back, and training continues bit for bit
as if nothing had moved (two optimizer steps compared with a twin policy that never
offloads)."""

from __future__ import annotations

from collections import Counter
from functools import partial

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.helpers.steps import dp_batch, reinforce_loss


def _worker(rank, world_size, hf_dir, dtype, params):
    from megatron_grpo.config.schema import ModelConfig, OptimConfig, ParallelConfig
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.policy import build_policy
    from megatron_grpo.policy.offload import TrainerOffload

    spec = load_spec(hf_dir)
    with distributed_context(ParallelConfig(), spec, seed=3) as ctx:
        mcfg, ocfg = ModelConfig(dtype=dtype), OptimConfig(lr=1e-2, clip_grad=1.0)
        a = build_policy(spec, ctx, mcfg, ocfg)
        b = build_policy(spec, ctx, mcfg, ocfg)
        b.copy_weights_from(a)
        batch = dp_batch(spec.vocab_size)
        loss_fn = partial(reinforce_loss, n_tokens=float(batch.loss_mask.sum()))
        off = TrainerOffload(a, params=params)
        # What the offload reserves ahead (with CUDA) before the first step: the host
        # buffers every later offload takes, torch Adam's state included.
        expected = Counter(off._expected_host_bytes())
        out = {"freed": [], "reloaded": [], "taken": []}
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
            out["taken"].append(Counter(h.numel() for _, h in off._kept) == expected)
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
    assert r["taken"] == [True, True], "the host buffers reserved ahead are not the ones taken"


def test_host_pool_hands_out_what_it_made_ahead():
    """``_HostPool`` (pin=False here; the same code pins with CUDA): ``take`` returns the
    buffers the background thread made, waiting for one still to come, allocates a size it
    was not asked for on the spot, and ``trim`` frees what nobody took."""
    import threading

    from megatron_grpo.policy.offload import _HostPool

    pool = _HostPool(pin=False)
    made: list[tuple[str, int]] = []
    release = threading.Event()

    def alloc(nbytes: int) -> torch.Tensor:
        made.append((threading.current_thread().name, nbytes))
        if threading.current_thread().name == "trainer-offload-host" and nbytes == 24:
            release.wait(timeout=30)  # the last reserved size arrives late
        return torch.empty(nbytes, dtype=torch.uint8)

    pool._alloc = alloc
    pool.reserve([16, 8, 16, 24])
    a, _ = pool.take(16)
    b, _ = pool.take(16)
    threading.Timer(0.2, release.set).start()
    c, _ = pool.take(24)  # waits for the thread rather than allocating it twice
    assert [t.numel() for t in (a, b, c)] == [16, 16, 24] and a.data_ptr() != b.data_ptr()
    pool._thread.join(timeout=30)
    assert made == [("trainer-offload-host", n) for n in (16, 8, 16, 24)]
    d, _ = pool.take(32)  # never reserved: made on the spot
    assert made[-1] == (threading.current_thread().name, 32) and d.numel() == 32
    pool.give(a)
    assert pool.take(16)[0] is a  # given back, taken again
    pool.give(b)
    pool.trim()  # the unused 8 and the returned 16 go
    assert pool._free == {} and pool.reserve_s is not None
    pool.take(8)
    assert made[-1] == (threading.current_thread().name, 8)
