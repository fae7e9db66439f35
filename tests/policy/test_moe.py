"""Mixture-of-experts policies (Qwen3-MoE, Qwen2-MoE): the spec, the layouts of experts over
EP ranks, the config checks, parity of the megatron MoE model with `transformers`, and the
conversion round trip.

The parity test builds the ``tiny-moe`` preset (4 experts, top-2, renormalised) and its
Qwen2-MoE sibling (QKV bias, plain top-k, a gated shared expert) in HF format, loads them
through ``megatron_grpo.layouts`` at EP=1 (one rank), EP=2 (two gloo ranks, dp=2: each rank
holds 2 experts, tokens cross ranks through megatron's alltoall dispatcher) and PP=2,
compares per-token log-probs with transformers' on the same weights, takes one optimizer
step on the batch split over the DP ranks, and gathers the HF weights back.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import torch

from megatron_grpo.config.schema import ConfigError, ParallelConfig
from megatron_grpo.distributed.validate import check_experts, validate_parallel
from megatron_grpo.layouts import hf
from megatron_grpo.layouts import megatron as mg
from megatron_grpo.layouts.io import gather_schedule
from megatron_grpo.layouts.pieces import assemble, reader_from_dict, scatter
from megatron_grpo.models.shapes import preset_spec
from megatron_grpo.models.spec import spec_from_hf_config
from megatron_grpo.models.tiny import hf_config_dict
from tests.dist_utils import run_distributed
from tests.helpers.layouts import MOE_VARIANTS, PRESET_SHAPE, arange_hf, moe_spec
from tests.helpers.numerics import check_rank_step
from tests.helpers.steps import MICRO_BATCH, hf_reference, make_batch, pg_loss

LOGP_TOL = 1e-5
WEIGHT_TOL = 1e-6


# --- the spec ----------------------------------------------------------------------------


def test_tiny_moe_preset_spec():
    spec = preset_spec("tiny-moe")
    assert (spec.family, spec.num_experts, spec.moe_topk, spec.moe_ffn_hidden_size) == (
        "qwen3_moe", 4, 2, 64,
    )  # fmt: skip
    assert spec.is_moe and spec.qk_norm and spec.norm_topk_prob and not spec.qkv_bias
    assert not preset_spec("tiny").is_moe
    # every HF tensor counted: embedding (tied) + per layer attention, router, 4 experts
    assert spec.num_parameters == sum(torch.Size(s).numel() for s in hf.hf_shapes(spec).values())


def test_moe_configs_the_trainer_cannot_build_are_refused():
    from megatron_grpo.models.spec import UnsupportedModelError

    shape = dict(PRESET_SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                 num_hidden_layers=2, tie_word_embeddings=False)  # fmt: skip
    for bad in (dict(decoder_sparse_step=2), dict(mlp_only_layers=[0])):
        with pytest.raises(UnsupportedModelError, match="every layer is MoE"):
            spec_from_hf_config(hf_config_dict({**shape, **bad}, 77))
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok <= num_experts"):
        spec_from_hf_config(hf_config_dict({**shape, "num_experts_per_tok": 5}, 77))


# --- config validation -------------------------------------------------------------------


def test_ep_that_does_not_divide_the_experts_is_one_line():
    spec = moe_spec(experts=6)
    with pytest.raises(ConfigError) as e:
        validate_parallel(ParallelConfig(ep=4), 4, spec, has_cuda=False)
    assert str(e.value) == (
        "parallel.ep(4) does not divide the model's 6 experts: every EP rank holds "
        "num_experts/ep of them; choose parallel.ep from [1, 2, 3, 6]."
    )


def test_ep_with_a_dense_model_is_one_line():
    dense = preset_spec("tiny")
    with pytest.raises(ConfigError) as e:
        check_experts(dense, 2, 1)
    assert str(e.value) == (
        "parallel.ep(2) > 1 needs a mixture-of-experts model, and Qwen2ForCausalLM is dense: "
        "set parallel.ep=1."
    )
    check_experts(dense, 1, 1)  # the dense default passes


def test_ep_must_divide_the_data_parallel_ranks():
    with pytest.raises(ConfigError, match=r"parallel.ep\(4\) does not divide dp\(2\)"):
        validate_parallel(ParallelConfig(tp=2, ep=4), 4, has_cuda=False)
    assert validate_parallel(ParallelConfig(ep=2), 2, moe_spec(), has_cuda=False) == 2


def test_expert_width_must_split_over_tp():
    with pytest.raises(ConfigError, match=r"moe_intermediate_size\(6\) is not divisible"):
        check_experts(moe_spec(moe_ffn=6), 1, 4)


# --- layouts -----------------------------------------------------------------------------


@pytest.mark.parametrize("shared", [0, 12], ids=["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 4), (2, 2, 2)])
def test_experts_round_trip_over_ep_ranks(tp, pp, ep, shared):
    """Cut every shard of every (pp, tp, ep) rank from arange-filled HF tensors, scatter back:
    each HF tensor returns whole, and local expert j of EP rank e reads HF expert e*E/ep+j."""
    spec = moe_spec(shared=shared)
    assert spec.qkv_bias == bool(shared) and spec.shared_expert_ffn_hidden_size == shared
    ml = mg.MegatronLayout(tp=tp, pp=pp, dp=ep, ep=ep)
    mg.validate(spec, ml)
    w = arange_hf(spec)
    read = reader_from_dict(w)
    back = {n: torch.zeros_like(t) for n, t in w.items()}
    for p, r, e in itertools.product(range(pp), range(tp), range(ep)):
        for lay in mg.chunk_shards(spec, ml, p, 0, r, e):
            if e > 0 and not mg.is_expert(lay.name):
                continue  # replicated over EP: EP rank 0's copy is the same
            scatter(lay, assemble(lay, read, torch.float64), back)
    for n, t in w.items():
        assert torch.equal(back[n], t), n
    # the last stage's local layer 0 is HF layer pp-1; the last EP rank's last local expert
    # is HF expert 3
    last = 4 // ep - 1
    lay = mg.shard(spec, ml, f"decoder.layers.0.mlp.experts.local_experts.{last}.linear_fc2.weight",
                   pp - 1, 0, tp - 1, ep - 1)  # fmt: skip
    assert lay.hf_names == (f"model.layers.{pp - 1}.mlp.experts.3.down_proj.weight",)


def test_gather_schedule_takes_each_expert_from_its_ep_rank_once():
    spec = moe_spec()
    ml = mg.MegatronLayout(tp=2, dp=2, ep=2)
    sched = gather_schedule(spec, ml)
    covered = [p.src for s in sched for p in s.layout.pieces if p.src]
    assert set(covered) == set(hf.hf_shapes(spec))
    experts = {(s.ep_rank, s.layout.hf_names[0].split(".")[5]) for s in sched
               if ".experts." in s.layout.hf_names[0]}  # fmt: skip
    assert experts == {(0, "0"), (0, "1"), (1, "2"), (1, "3")}
    assert all(s.ep_rank == 0 for s in sched if not mg.is_expert(s.layout.name))


def test_unknown_expert_names_raise():
    spec = moe_spec()
    ml = mg.MegatronLayout(dp=2, ep=2)
    with pytest.raises(mg.UnknownParameterError, match="experts=4/ep 2"):
        mg.shard(spec, ml, "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight")
    with pytest.raises(mg.UnknownParameterError):  # a dense MLP name in an MoE layer
        mg.shard(spec, ml, "decoder.layers.0.mlp.linear_fc1.weight")


# --- parity with transformers ------------------------------------------------------------


def _ep_worker(rank, world_size, ep, models, batch, aux_loss=0.0, dist_opt="auto", pp=1):
    from megatron_grpo.config.schema import ModelConfig, OptimConfig
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.layouts import gather_hf_state_dict, load_hf_into_megatron
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.policy import build_policy

    with distributed_context(ParallelConfig(ep=ep, pp=pp), seed=1) as ctx:
        out = {}
        for name, hf_dir in models.items():
            spec = load_spec(hf_dir)
            policy = build_policy(
                spec, ctx, ModelConfig(moe_aux_loss_coeff=aux_loss),
                OptimConfig(lr=1e-3, clip_grad=1.0, adam_eps=1e-2, distributed_optimizer=dist_opt),
                init_weights=lambda chunks, d=hf_dir, s=spec: load_hf_into_megatron(
                    chunks, d, s, ctx),
            )  # fmt: skip
            loaded = gather_hf_state_dict(policy.models, spec, ctx)
            logp = policy.compute_logprobs(batch, MICRO_BATCH)
            # the DP ranks split the batch's rows; the loss keeps the global normalizer
            n_tokens = float(batch.loss_mask.sum())
            rows = batch.num_rows // ctx.dp
            mine = batch.select(slice(ctx.dp_rank * rows, (ctx.dp_rank + 1) * rows))
            metrics = policy.train_step(mine, partial(pg_loss, n_tokens=n_tokens), MICRO_BATCH)
            weights = gather_hf_state_dict(policy.models, spec, ctx)
            out[name] = {"logp": logp["logp"], "metrics": metrics, "loaded": loaded,
                         "weights": weights}  # fmt: skip
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_logprobs_and_step_match_hf_at_ep1_and_ep2(tiny_moe_dirs):
    from safetensors.torch import load_file

    from megatron_grpo.models.spec import load_spec

    torch.set_num_threads(1)
    batch = make_batch(load_spec(tiny_moe_dirs["qwen3_moe"]).vocab_size)
    refs = {name: hf_reference(d, batch) for name, d in tiny_moe_dirs.items()}
    qwen3 = {"qwen3_moe": tiny_moe_dirs["qwen3_moe"]}
    with ThreadPoolExecutor(5) as pool:
        futures = {
            ep: pool.submit(run_distributed, _ep_worker, ep, ep, tiny_moe_dirs, batch, timeout=500)
            for ep in (1, 2)
        }
        aux = pool.submit(run_distributed, _ep_worker, 1, 1, qwen3, batch, 0.1, timeout=500)
        # the GPU default: megatron's DistributedOptimizer (expert params in their own
        # optimizer over the expert-data-parallel group)
        dist_opt = pool.submit(
            run_distributed, _ep_worker, 2, 2, qwen3, batch, 0.0, "on", timeout=500
        )
        # MoE layers split over two pipeline stages (Qwen2-MoE: its shared expert too)
        piped = pool.submit(
            run_distributed, _ep_worker, 2, 1, tiny_moe_dirs, batch, 0.0, "auto", 2, timeout=500
        )
        results = {ep: f.result() for ep, f in futures.items()}
        results["pp2"] = piped.result()
        aux_result = aux.result()[0]["qwen3_moe"]
        dist_opt_result = dist_opt.result()[0]["qwen3_moe"]

    report = []
    for name, hf_dir in tiny_moe_dirs.items():
        on_disk = load_file(f"{hf_dir}/model.safetensors")
        base = results[1][0][name]
        for ep, ranks in results.items():
            for r, res in enumerate(ranks):
                check_rank_step(res[name], base, refs[name], tol=LOGP_TOL, loss_abs=1e-6,
                                label=f"{name} {ep=} rank {r}", report=report)  # fmt: skip
            loaded, weights = ranks[0][name]["loaded"], ranks[0][name]["weights"]
            assert loaded.keys() == on_disk.keys() - {hf.LM_HEAD}
            for k in loaded:  # load then gather is bit-exact
                assert torch.equal(loaded[k], on_disk[k]), f"{name} ep={ep}: {k}"
            d_w = max((weights[k] - base["weights"][k]).abs().max().item() for k in weights)
            report.append(f"{name} {ep=}: updated weights vs ep=1 {d_w:.2e}")
            assert d_w < WEIGHT_TOL, report[-1]
        # the step moved every expert of every layer (top-2 of 4 over ~30 tokens routes to
        # all), and the shared expert and its gate
        for k, t in base["weights"].items():
            if ".experts." in k or "shared_expert" in k:
                assert not torch.equal(t, on_disk[k]), f"{name}: {k} did not change"
    print("\n".join(report))
    base = results[1][0]["qwen3_moe"]
    d_w = max(
        (dist_opt_result["weights"][k] - base["weights"][k]).abs().max().item()
        for k in base["weights"]
    )
    assert d_w < WEIGHT_TOL, f"EP=2 with the distributed optimizer vs EP=1: {d_w:.2e}"
    assert dist_opt_result["metrics"]["grad_norm"] == pytest.approx(
        base["metrics"]["grad_norm"], rel=1e-5
    )
    # model.moe_aux_loss_coeff > 0: the same forward and policy loss, and the load-balancing
    # loss's gradient (megatron's MoEAuxLossAutoScaler, outside the returned loss) moves the
    # routers differently
    base = results[1][0]["qwen3_moe"]
    assert torch.equal(aux_result["logp"], base["logp"])
    assert aux_result["metrics"]["loss"] == base["metrics"]["loss"]
    routers = [k for k in base["weights"] if k.endswith("mlp.gate.weight")]
    assert routers and all(
        not torch.equal(aux_result["weights"][k], base["weights"][k]) for k in routers
    )


# --- conversion round trip at EP=2 -------------------------------------------------------


def _convert_worker(rank, world_size, fn_name, *args):
    """``checkpoints_tools`` conversions run as one process: a 1-rank spawn keeps megatron's
    global state out of the test process."""
    from checkpoints_tools import hf_to_mcore, mcore_to_hf
    from megatron_grpo.platform.lifetime import start_checkpoint_manager

    # dist_checkpointing.save's write-results Manager, bound to this rank: spawned ranks end
    # with os._exit, which would leave megatron's own Manager process behind
    start_checkpoint_manager()

    fn = {"hf_to_mcore": hf_to_mcore, "mcore_to_hf": mcore_to_hf}[fn_name]
    fn(*args)


def _ep2_load_save_worker(rank, world_size, ckpt_in, ckpt_out, hf_dir):
    """EP=2: load the (EP=1) converted checkpoint into a policy, gather its HF weights, and
    save the policy's model state as a dist checkpoint of its own."""
    from megatron.core import dist_checkpointing

    from megatron_grpo.config.schema import ModelConfig
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.layouts import gather_hf_state_dict
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.platform.lifetime import start_checkpoint_manager
    from megatron_grpo.policy import build_policy

    start_checkpoint_manager()  # as in _convert_worker
    spec = load_spec(hf_dir)
    with distributed_context(ParallelConfig(ep=2), spec, seed=1) as ctx:
        policy = build_policy(spec, ctx, ModelConfig())  # forward only: megatron's random init
        loaded = dist_checkpointing.load(policy.sharded_state_dict(for_loading=True), ckpt_in)
        policy.load_sharded_state_dict(loaded)
        weights = gather_hf_state_dict(policy.models, spec, ctx)
        dist_checkpointing.save(policy.sharded_state_dict(), ckpt_out)
    return weights


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("family", list(MOE_VARIANTS))
def test_conversion_round_trip_through_ep2_is_bit_exact(tiny_moe_dirs, family, tmp_path):
    """HF -> dist checkpoint (one process, EP=1) -> an EP=2 policy (each rank reads its two
    experts) -> its own dist checkpoint -> HF: every tensor bit-exact, and the EP=2 policy
    holds exactly the HF weights."""
    from safetensors.torch import load_file

    tiny_moe_dir = tiny_moe_dirs[family]

    ckpt = tmp_path / "mcore"
    run_distributed(_convert_worker, 1, "hf_to_mcore", tiny_moe_dir, ckpt, timeout=300)
    saved = tmp_path / "ep2"
    saved.mkdir()
    gathered = run_distributed(
        _ep2_load_save_worker, 2, str(ckpt), str(saved), tiny_moe_dir, timeout=300
    )[0]
    back = tmp_path / "hf_back"
    run_distributed(_convert_worker, 1, "mcore_to_hf", saved, back, tiny_moe_dir, timeout=300)

    original = load_file(f"{tiny_moe_dir}/model.safetensors")
    returned = {}
    for f in sorted(back.glob("*.safetensors")):
        returned.update(load_file(str(f)))
    assert gathered.keys() == returned.keys() == original.keys() - {hf.LM_HEAD}
    for k, t in original.items():
        if k in returned:
            assert torch.equal(gathered[k], t), f"EP=2 policy: {k}"
            assert torch.equal(returned[k], t), f"round trip: {k}"
