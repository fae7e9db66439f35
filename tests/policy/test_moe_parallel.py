"""MoE policies at the parallel layouts tests/policy/test_moe.py does not run: resume at EP=2, and
TP=2 (with and without EP=2) against transformers.

- Resume: EP=2 (dp=2, each rank holds 2 of the 4 experts) trains 2 steps, saves, trains 2
  more; a fresh EP=2 policy loads the checkpoint and trains the same 2 steps: losses and
  every shard equal bit for bit, in the GPU configuration (bf16, megatron's distributed
  optimizer: the experts' main params in their own optimizer over the expert-data-parallel
  group) and in fp32 with the plain optimizer.
- TP=2, TP=2 x EP=2 (4 ranks): per-token log-probs equal transformers' (fp32, <= 1e-5), both
  families; the experts are split over expert-TP = TP, tokens gathered over it by the
  alltoall dispatcher. Training at TP > 1 needs sequence parallelism (megatron's MoELayer
  raises otherwise, which the 2-rank worker records), and sequence parallelism needs
  Transformer Engine, so on CPU a TP > 1 MoE run is refused at preflight (tests/policy/test_moe.py
  has the refusal; docs/moe.md).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from megatron_grpo.config.schema import ModelConfig, OptimConfig, ParallelConfig, RolloutConfig
from tests.dist_utils import run_distributed
from tests.helpers.steps import (
    MICRO_BATCH,
    build_policy_at,
    hf_reference,
    make_batch,
    pg_loss,
    refusal,
    shard_copies,
    train_steps,
)

LOGP_TOL = 1e-5

RESUME_CONFIGS = (("bfloat16", "on"), ("float32", "off"))


def _resume_at_ep2(ctx, hf_dir: str, run_dir: str, dtype: str, dist_opt: str) -> dict:
    from megatron_grpo.checkpoint import LoopState, load_checkpoint, save_checkpoint

    a = build_policy_at(hf_dir, ctx, dtype, dist_opt)
    start = shard_copies(a)
    train_steps(a, ctx, 0, 2)
    save_checkpoint(run_dir, LoopState(step=2), {"model": a.sharded_state_dict})
    losses_a = train_steps(a, ctx, 2, 4)
    after_a = shard_copies(a)
    b = build_policy_at(hf_dir, ctx, dtype, dist_opt)  # loads the HF weights, then the checkpoint
    ck = load_checkpoint(run_dir, {"model": b.sharded_state_dict(for_loading=True)})
    b.load_sharded_state_dict(ck.state_dicts["model"])
    losses_b = train_steps(b, ctx, 2, 4)
    experts = [n for n in after_a if ".local_experts." in n]
    return {
        "losses": (losses_a, losses_b),
        "weights_equal": all(torch.equal(after_a[n], p) for n, p in b.named_shards()),
        "experts_moved": bool(experts)
        and all(not torch.equal(start[n], after_a[n]) for n in experts),
    }


def _tp_logprobs(ctx, models: dict, batch, train: bool = False) -> dict:
    from megatron_grpo.layouts import load_hf_into_megatron
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.policy import build_policy

    out = {}
    for name, hf_dir in models.items():
        spec = load_spec(hf_dir)
        init = partial(load_hf_into_megatron, hf_dir=hf_dir, spec=spec, ctx=ctx)
        optim = OptimConfig(lr=1e-3) if train else None
        policy = build_policy(spec, ctx, ModelConfig(), optim, init_weights=init)
        out[name] = policy.compute_logprobs(batch, MICRO_BATCH)["logp"]
        if train:  # megatron's own refusal, the reason for preflight's
            loss = partial(pg_loss, n_tokens=1.0)
            out["train_error"] = refusal(ValueError, policy.train_step, batch, loss, MICRO_BATCH)
    return out


def _two_ranks(rank, world, models, run_dir, batch):
    from megatron_grpo.distributed import destroy_distributed, init_distributed
    from megatron_grpo.models.spec import load_spec

    hf_dir = models["qwen3_moe"]
    out = {"resume": {}}
    try:
        ctx = init_distributed(ParallelConfig(ep=2), load_spec(hf_dir), seed=11)
        for dtype, dist_opt in RESUME_CONFIGS:
            out["resume"][dtype, dist_opt] = _resume_at_ep2(
                ctx, hf_dir, f"{run_dir}/{dtype}-{dist_opt}", dtype, dist_opt
            )
        ctx = init_distributed(ParallelConfig(tp=2), load_spec(hf_dir), seed=11)
        out["tp2"] = _tp_logprobs(ctx, models, batch, train=True)
    finally:
        destroy_distributed()
    return out


def _four_ranks(rank, world, models, batch):
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.models.spec import load_spec

    with distributed_context(ParallelConfig(tp=2, ep=2), load_spec(models["qwen3_moe"])) as ctx:
        assert (ctx.tp, ctx.dp, ctx.ep) == (2, 2, 2)
        return _tp_logprobs(ctx, models, batch)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ep2_resume_is_bit_exact_and_tp2_matches_hf(tiny_moe_dirs, tmp_path):
    from megatron_grpo.models.spec import load_spec

    torch.set_num_threads(1)
    batch = make_batch(load_spec(tiny_moe_dirs["qwen3_moe"]).vocab_size)
    # One group at a time: two groups rendezvousing at once can meet on one port (seen in CI:
    # "Gloo connectFullMesh failed ... Connection closed by peer").
    two = run_distributed(_two_ranks, 2, tiny_moe_dirs, str(tmp_path), batch, timeout=550)
    four = run_distributed(_four_ranks, 4, tiny_moe_dirs, batch, timeout=550)
    refs = {name: hf_reference(d, batch) for name, d in tiny_moe_dirs.items()}

    for rank, res in enumerate(two):
        for cfg, r in res["resume"].items():
            where = f"EP=2 rank {rank} {cfg}"
            assert r["experts_moved"], where
            assert r["losses"][0] == r["losses"][1], where
            assert r["weights_equal"], where
    report = []
    for layout, ranks in (("tp2", [r["tp2"] for r in two]), ("tp2 x ep2", four)):
        for rank, res in enumerate(ranks):
            for name, ref in refs.items():
                d = (res[name] - ref).abs().max().item()
                report.append(f"{name} {layout} rank {rank}: logp vs HF {d:.2e}")
                assert d < LOGP_TOL, report[-1]
    print("\n".join(report))
    assert "without also enabling sequence parallelism" in two[0]["tp2"]["train_error"]


def test_preflight_refuses_moe_tp_it_cannot_train_or_serve():
    """Preflight refuses what megatron's MoELayer would refuse at the first train step
    (recorded by the 2-rank worker above), and a rollout TP that cannot split an expert;
    a dense model at TP=2, and TP=2 with sequence parallelism (GPU), pass."""
    from megatron_grpo.config import Config, ConfigError
    from megatron_grpo.models.shapes import preset_spec
    from megatron_grpo.trainer.preflight import check_moe
    from tests.helpers.layouts import moe_spec

    with pytest.raises(ConfigError) as e:
        check_moe(moe_spec(), Config(parallel=ParallelConfig(tp=2)))
    assert str(e.value).startswith(
        "parallel.tp(2) > 1 with an MoE model needs parallel.sequence_parallel=true"
    )
    check_moe(moe_spec(), Config(parallel=ParallelConfig(tp=2, sequence_parallel=True)))
    check_moe(preset_spec("tiny"), Config(parallel=ParallelConfig(tp=2)))
    with pytest.raises(ConfigError, match=r"rollout.tp\(4\) does not divide the model's "
                       r"moe_intermediate_size\(6\)"):  # fmt: skip
        check_moe(moe_spec(moe_ffn=6), Config(rollout=RolloutConfig(tp=4)))
