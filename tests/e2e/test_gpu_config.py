"""The GPU configuration, run on CPU: every ``auto`` forced to the value it takes on a GPU.

On a GPU ``model.dtype=auto`` is bfloat16 (fp32 main params in megatron's optimizer),
``optim.distributed_optimizer=auto`` is on and ``optim.fused_adam=auto`` steps them with
torch's fused AdamW; the CPU suite used to run only the CPU values, so
the configuration every user runs was never executed before a user ran it. The CPU platform
layer (platform/cpu.py) lets both megatron optimizers build on CPU, so this tier runs them:

- train, checkpoint, resume and continue **bit for bit** at world 1, DP2 and TP2, with the
  distributed optimizer in bf16 (plus the plain bf16 optimizer, and the distributed one in
  fp32, whose resume used to fail with an in-place error on a leaf view);
- the distributed optimizer's checkpoint loads at another layout (DP2 -> TP2): it is
  saved in megatron's ``fully_reshardable`` format;
- offload -> reload -> step equals the step without it;
- ``copy_weights_from`` reaches the optimizer's fp32 main params: a zero-gradient step
  afterwards leaves exactly the source's weights;
- the nccl branch's backend-independent arguments (no extra gloo groups, the optimizer's
  ``use_gloo_process_groups=False``) are the ones every run uses;
- a fixed-seed end-to-end ``train`` of the tiny job in the GPU configuration (bf16,
  distributed optimizer, fused AdamW, 2 ranks, real vLLM), interrupted and resumed, against
  its golden numbers.

Only CUDA kernels stay for tests/gpu (docs/gpu-census.md lists every branch and its test).
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_grpo.config.schema import ParallelConfig
from tests.dist_utils import run_distributed
from tests.helpers.numerics import cpu_kind
from tests.helpers.steps import adv_loss, build_policy_at, gpu_batch, shard_copies, train_steps


def _zero_loss(logp, entropy, mb):
    return (logp * 0.0).sum(), {}


def _resume_worker(rank, world, hf_dir, run_dir, tp, dtype, dist_opt):
    from megatron_grpo.checkpoint import LoopState, load_checkpoint, save_checkpoint
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.policy.offload import TrainerOffload
    from megatron_grpo.policy.optimizer import torch_adams

    with distributed_context(ParallelConfig(tp=tp), load_spec(hf_dir), seed=11) as ctx:
        a = build_policy_at(hf_dir, ctx, dtype, dist_opt, fused_adam="on")
        out = {
            "optimizer": type(
                getattr(a.optimizer, "chained_optimizers", [a.optimizer])[0]
            ).__name__,
            "dtypes": sorted({str(p.dtype) for _, p in a.named_shards()}),
            "main_dtypes": sorted(
                {str(p.dtype) for g in a.optimizer.param_groups for p in g["params"]}
            ),
        }
        train_steps(a, ctx, 0, 2)
        save_checkpoint(run_dir, LoopState(step=2), {"model": a.sharded_state_dict})
        losses_a = train_steps(a, ctx, 2, 4)
        after_a = shard_copies(a)
        # A fresh policy (its own random init overwritten by the load) continues the same way.
        b = build_policy_at(hf_dir, ctx, dtype, dist_opt, fused_adam="on")
        ck = load_checkpoint(run_dir, {"model": b.sharded_state_dict(for_loading=True)})
        b.load_sharded_state_dict(ck.state_dicts["model"])
        out["fused_after_load"] = sorted(
            {g["fused"] for o in torch_adams(b.optimizer) for g in o.param_groups}
        )
        losses_b = train_steps(b, ctx, 2, 4)
        out["resume_losses_equal"] = losses_a == losses_b
        out["resume_weights_equal"] = all(torch.equal(after_a[n], p) for n, p in b.named_shards())
        # offload -> reload -> step == step
        off = TrainerOffload(b)
        off.offload()
        off.reload()
        train_steps(a, ctx, 4, 5)
        train_steps(b, ctx, 4, 5)
        out["offload_weights_equal"] = all(
            torch.equal(p, q) for (_, p), (_, q) in zip(a.named_shards(), b.named_shards())
        )
        return out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "world,tp,dtype,dist_opt",
    [
        (1, 1, "bfloat16", "on"),
        (2, 1, "bfloat16", "on"),  # DP2: each rank steps its half of the main params
        (2, 2, "bfloat16", "on"),  # TP2
        (1, 1, "bfloat16", "off"),  # the plain Float16 optimizer with fp32 main params
        (2, 1, "float32", "on"),  # fp32 + distributed optimizer: resume loads under no_grad
    ],
    ids=[
        "world1-bf16-distopt",
        "dp2-bf16-distopt",
        "tp2-bf16-distopt",
        "world1-bf16-plain",
        "dp2-fp32-distopt",
    ],  # fmt: skip
)
def test_gpu_configuration_trains_checkpoints_resumes_bit_for_bit(
    tmp_path, tiny_dir, world, tp, dtype, dist_opt
):
    res = run_distributed(
        _resume_worker, world, tiny_dir, str(tmp_path / "run"), tp, dtype, dist_opt, timeout=280
    )
    for r in res:
        assert r["dtypes"] == [f"torch.{dtype}"], r  # norms included: one dtype for every param
        assert r["main_dtypes"] == ["torch.float32"], r  # the optimizer steps fp32 main params
        want = "DistributedOptimizer" if dist_opt == "on" else (
            "Float16OptimizerWithFloat16Params" if dtype == "bfloat16" else "FP32Optimizer"
        )  # fmt: skip
        assert r["optimizer"] == want, r
        assert r["resume_losses_equal"] and r["resume_weights_equal"], r
        assert r["fused_after_load"] == [True], r  # torch's fused AdamW, also after the load
        assert r["offload_weights_equal"], r


def _save_worker(rank, world, hf_dir, run_dir):
    from megatron_grpo.checkpoint import LoopState, save_checkpoint
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.layouts.io import gather_hf_state_dict
    from megatron_grpo.models.spec import load_spec

    spec = load_spec(hf_dir)
    with distributed_context(ParallelConfig(), spec, seed=11) as ctx:
        a = build_policy_at(hf_dir, ctx, "bfloat16", "on")
        train_steps(a, ctx, 0, 2)
        save_checkpoint(run_dir, LoopState(step=2), {"model": a.sharded_state_dict})
        full = gather_hf_state_dict(a.models, spec, ctx)
        loss = train_steps(a, ctx, 2, 3)
        return {k: v.clone() for k, v in full.items()} if rank == 0 else None, loss


def _load_tp2_worker(rank, world, hf_dir, run_dir):
    from megatron_grpo.checkpoint import load_checkpoint
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.layouts.io import gather_hf_state_dict
    from megatron_grpo.models.spec import load_spec

    spec = load_spec(hf_dir)
    with distributed_context(ParallelConfig(tp=2), spec, seed=11) as ctx:
        b = build_policy_at(hf_dir, ctx, "bfloat16", "on")
        ck = load_checkpoint(run_dir, {"model": b.sharded_state_dict(for_loading=True)})
        b.load_sharded_state_dict(ck.state_dicts["model"])
        full = gather_hf_state_dict(b.models, spec, ctx)
        # The whole step-2 batch on the one DP rank: the same global objective as DP2's.
        first, second = gpu_batch(b.vocab_size, 200), gpu_batch(b.vocab_size, 201)
        batch = first.map_rows(lambda name, v: torch.cat([v, getattr(second, name)]))
        loss = b.train_step(batch, adv_loss, micro_batch_size=2)["loss"]
        return ({k: v.clone() for k, v in full.items()} if rank == 0 else None), loss


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_distributed_optimizer_checkpoint_reshards_dp2_to_tp2(tmp_path, tiny_dir):
    run = str(tmp_path / "run")
    saved = run_distributed(_save_worker, 2, tiny_dir, run, timeout=280)
    loaded = run_distributed(_load_tp2_worker, 2, tiny_dir, run, timeout=280)
    before, after = saved[0][0], loaded[0][0]
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)  # weights: exact
    # The next step on the same global batch has DP2's loss (train_step reports the global
    # objective, summed over DP ranks), to float rounding of another reduction order.
    assert saved[0][1] == saved[1][1]
    assert loaded[0][1] == pytest.approx(saved[0][1][0], rel=1e-3)


def _copy_worker(rank, world, hf_dir, dist_opt):
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.models.spec import load_spec

    with distributed_context(ParallelConfig(), load_spec(hf_dir), seed=11) as ctx:
        src = build_policy_at(hf_dir, ctx, "bfloat16", dist_opt)
        train_steps(src, ctx, 0, 2)  # the source moves away from the HF weights
        dst = build_policy_at(hf_dir, ctx, "bfloat16", dist_opt)
        dst.copy_weights_from(src)
        m = dst.train_step(gpu_batch(dst.vocab_size, 7), _zero_loss, micro_batch_size=2)
        same = all(
            torch.equal(p, q) for (_, p), (_, q) in zip(src.named_shards(), dst.named_shards())
        )
        return same, m["grad_norm"], m["skipped"]


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("dist_opt", ["on", "off"])
def test_copy_weights_from_reaches_the_fp32_main_params(tiny_dir, dist_opt):
    [(same, grad_norm, skipped)] = run_distributed(_copy_worker, 1, tiny_dir, dist_opt, timeout=180)
    assert grad_norm == 0.0 and not skipped
    assert same, "the step continued from the target's old fp32 main params"


def test_nccl_branch_arguments_are_the_cpu_ones(monkeypatch):
    """The optimizer and megatron's groups get the same backend-independent arguments on
    both backends: no gloo groups beside a pg_collection (megatron refuses the pair,
    process_groups_config.py), no extra gloo groups from initialize_model_parallel."""
    import inspect

    from megatron_grpo.distributed import setup
    from megatron_grpo.policy import optimizer

    src = inspect.getsource(optimizer._build_optimizer)
    assert "use_gloo_process_groups=False" in src and "pg_collection=ctx.pg_collection" in src
    src = inspect.getsource(setup._init_megatron)  # init_distributed's megatron step
    assert "create_gloo_process_groups=False" in src
    assert setup.process_group_backend("nccl") == "cpu:gloo,cuda:nccl"


# ------------------------------------------------------------------ end to end, golden
# (loss, reward_mean, grad_norm) per step of the tiny job in the GPU configuration: bf16,
# distributed optimizer, 2 ranks (DP2), 2 colocated vLLM engines, v=2, with the defaults of
# their time (SDPA core attention, packed micro-batches). Recorded on the 2-core CPU machine;
# the uninterrupted run and the run resumed from step 2 both produce them, bit for bit.
# Re-recorded once, when the SDPA attention and packing landed (issue 22): the same samples
# and rewards, losses and grad norms within 1.3e-3 relative of the unfused, padded bf16 run
# (bf16 rounds the two attentions' sums differently).
# torch's fused AdamW (optim.fused_adam, on with CUDA) joined the configuration in issue 31
# without a re-record: the run with it reproduces these within the test's rel=1e-4.
GOLDEN_GPU_CONFIG_BY_CPU = {
    "reference": [
        (0.10863877460360527, 0.46875, 2.0762410049197695),
        (0.12159162014722824, 0.34375, 2.2546974525575667),
        (0.09014595299959183, 0.34375, 2.652578981106327),
        (-0.07268397323787212, 0.4375, 1.6698113655868636),
    ],
    # An Intel Xeon with AMX (tests.helpers.numerics.cpu_kind): oneDNN's AMX bf16 matmuls
    # round differently (1.7e-3 relative at step 1), the same samples and rewards; recorded
    # there on 2026-11-27 (main's 5a9dd28 gives the same first step there).
    "avx512+amx": [
        (0.10845836997032166, 0.46875, 2.0743161051114076),
        (0.12162726745009422, 0.34375, 2.2530067275243586),
        (0.0905890017747879, 0.34375, 2.6584665362748896),
        (-0.07265164889395237, 0.4375, 1.665717220079473),
    ],
}
GOLDEN_GPU_CONFIG = GOLDEN_GPU_CONFIG_BY_CPU[cpu_kind()]
GPU_CONFIG = [
    "model.dtype=bfloat16",
    "optim.distributed_optimizer=on",
    "optim.fused_adam=on",
    "checkpoint.interval=2",
]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_golden_gpu_configuration_dp2_resumed_from_step_2(tmp_path):
    from tests.helpers.runs import FAST, torchrun_train

    run = tmp_path / "r"
    common = ["--sync-interval", "2", *FAST, *GPU_CONFIG]
    rc, out, left = torchrun_train(run, "--steps", "2", *common, timeout=400)
    assert rc == 0 and not left, out[-3000:]
    rc, out, left = torchrun_train(run, "--steps", "4", "--resume", *common, timeout=400)
    assert rc == 0 and not left, out[-3000:]
    assert "resumed from" in out
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    got = [(r["loss"], r["reward_mean"], r["grad_norm"]) for r in rows]
    assert len(got) == len(GOLDEN_GPU_CONFIG), got
    for step, (g, want) in enumerate(zip(got, GOLDEN_GPU_CONFIG), start=1):
        assert g == pytest.approx(want, rel=1e-4, abs=1e-6), (step, got)
    for r in rows:  # pi = alpha at lag 0: the bf16 trainer scores what vLLM sampled
        if r["lag"] == 0:
            assert abs(r["ratio_mean"] - 1.0) < 1e-2, r
