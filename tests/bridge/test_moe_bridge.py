"""MoE weights through the resharding bridge (issue 32): vLLM's fused-expert layout as
expert slots, and the plan that sends each expert shard from the EP rank that owns it.

vLLM semantics checked here, written from vLLM 0.32's loaders (models/qwen3_moe.py
``load_weights``/``expert_params_mapping``, layers/fused_moe/layer.py ``weight_loader``), not
from megatron_grpo.layouts: TP rank r of T holds every expert e; ``w13_weight[e]`` is
``[gate_e rows r*I/T..; up_e rows r*I/T..]``, ``w2_weight[e]`` the columns ``r*I/T..`` of
``down_e``; the router ``mlp.gate.weight`` is whole on every rank.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from megatron_grpo.bridge.plan import build_plan, plan_report, rank_lookup, src_name
from megatron_grpo.layouts import megatron as mg
from megatron_grpo.layouts import vllm as vl
from megatron_grpo.layouts.pieces import assemble, reader_from_dict
from tests.dist_utils import run_distributed
from tests.helpers.bridge import (
    ENGINE_KW,
    check_delivers,
    execute,
    model_pair,
    placed_engines,
    sync_b_over_a,
)
from tests.helpers.layouts import MOE_VARIANTS, arange_hf, moe_spec
from tests.nccl_rules import ENV as NCCL_RULES_ENV

F64 = torch.float64


def moe_trainer_state(spec, trainer: mg.MegatronLayout) -> dict[tuple[int, str], torch.Tensor]:
    """(global rank, src_name) -> shard as each trainer rank holds it: DP rank d is EP rank
    d % ep and holds only that EP rank's experts (megatron's order tp-cp-ep-dp-pp)."""
    read = reader_from_dict(arange_hf(spec))
    global_rank = rank_lookup(trainer)
    out = {}
    for dp, pp, vp, tp in itertools.product(
        range(trainer.dp), range(trainer.pp), range(trainer.vpp), range(trainer.tp)
    ):
        for lay in mg.chunk_shards(spec, trainer, pp, vp, tp, ep_rank=dp % trainer.ep):
            key = (global_rank(dp, pp, tp), src_name(trainer, vp, lay.name))
            out[key] = assemble(lay, read, F64)
    return out


def vllm_reference(spec, w: dict[str, torch.Tensor], tp: int, r: int) -> dict[str, torch.Tensor]:
    """The MoE tensors of vLLM TP rank r, as fused parameters (E, ...)."""
    out = {}
    cols = spec.moe_ffn_hidden_size // tp
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}.mlp."
        out[p + "gate.weight"] = w[p + "gate.weight"]
        w13, w2 = [], []
        for e in range(spec.num_experts):
            x = f"{p}experts.{e}."
            gate, up = w[x + "gate_proj.weight"], w[x + "up_proj.weight"]
            w13.append(torch.cat([gate[r * cols : (r + 1) * cols], up[r * cols : (r + 1) * cols]]))
            w2.append(w[x + "down_proj.weight"][:, r * cols : (r + 1) * cols])
        out[p + "experts.routed_experts.w13_weight"] = torch.stack(w13)
        out[p + "experts.routed_experts.w2_weight"] = torch.stack(w2)
        if spec.shared_expert_ffn_hidden_size:  # a Qwen2MoeMLP split over TP, and its gate
            s = spec.shared_expert_ffn_hidden_size // tp
            x = p + "shared_expert."
            gate, up = w[x + "gate_proj.weight"], w[x + "up_proj.weight"]
            out[x + "gate_up_proj.weight"] = torch.cat(
                [gate[r * s : (r + 1) * s], up[r * s : (r + 1) * s]]
            )
            out[x + "down_proj.weight"] = w[x + "down_proj.weight"][:, r * s : (r + 1) * s]
            out[p + "shared_expert_gate.weight"] = w[p + "shared_expert_gate.weight"]
    return out


def fused(shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Expert slots put back into their fused parameters; other names as they are."""
    slots: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for name, t in shards.items():
        slot = vl.expert_slot(name)
        if slot is None:
            out[name] = t
        else:
            slots.setdefault(slot[0], {})[slot[1]] = t
    for name, by_e in slots.items():
        out[name] = torch.stack([by_e[e] for e in range(len(by_e))])
    return out


@pytest.mark.parametrize("shared", [0, 8], ids=["qwen3_moe", "qwen2_moe"])
def test_vllm_expert_slots_match_vllms_fused_layout(shared):
    spec = moe_spec(experts=4, moe_ffn=8, shared=shared)
    w = arange_hf(spec)
    read = reader_from_dict(w)
    names = vl.param_names(spec)
    assert "model.layers.1.mlp.gate.weight" in names
    assert "model.layers.1.mlp.experts.routed_experts.w2_weight.3" in names
    assert not any(".experts.0.gate_proj" in n or ".mlp.gate_up_proj" in n for n in names)
    assert vl.expert_slot("model.layers.1.mlp.experts.routed_experts.w13_weight.3") == (
        "model.layers.1.mlp.experts.routed_experts.w13_weight",
        3,
    )
    assert vl.expert_slot("model.layers.1.mlp.gate.weight") is None
    for tp in (1, 2, 4):
        for r in range(tp):
            got = fused({lay.name: assemble(lay, read, F64) for lay in vl.rank_shards(spec, tp, r)})
            ref = vllm_reference(spec, w, tp, r)
            for name, t in ref.items():
                assert torch.equal(got[name], t), (tp, r, name)
            assert all(".mlp." not in n or n in ref for n in got), sorted(set(got) - set(ref))


def test_vllm_moe_refusals():
    with pytest.raises(ValueError, match="moe_intermediate_size=6 not divisible by rollout tp=4"):
        vl.validate(moe_spec(moe_ffn=6, experts=4), 4)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=6 not divisible"):
        vl.validate(moe_spec(shared=6), 4)


@pytest.mark.parametrize("tp,pp,ep,dp", [(1, 1, 2, 2), (2, 1, 2, 2), (1, 2, 2, 2), (1, 1, 2, 4)])
@pytest.mark.parametrize("vtp", [1, 2])
@pytest.mark.parametrize("placement", ["colocated", "separate"])
@pytest.mark.parametrize("shared", [0, 8], ids=["qwen3_moe", "qwen2_moe"])
def test_moe_plan_sends_each_expert_from_its_ep_rank(tp, pp, ep, dp, vtp, placement, shared):
    spec = moe_spec(experts=4, moe_ffn=8, shared=shared)
    trainer = mg.MegatronLayout(tp=tp, pp=pp, dp=dp, ep=ep)
    engines = placed_engines(placement, tp * pp * dp, vtp)
    plan = build_plan(spec, trainer, vtp, engines, element_size=4)
    # each trainer rank holds only its EP rank's experts under the shared local names, so a
    # copy read from the wrong EP rank would put another expert's values here
    expected_bytes = check_delivers(plan, moe_trainer_state(spec, trainer), spec, engines, vtp)
    assert plan.minimal_bytes == expected_bytes == plan_report(plan).bytes_per_sync
    per_ep = spec.num_experts // ep
    for c in plan.copies:  # an expert leaves only from its EP rank (dp_rank % ep)
        if mg.is_expert(c.src_name):
            dp_rank = (c.src_rank // tp) % dp
            assert dp_rank % ep == int(c.dst_name.rsplit(".", 1)[1]) // per_ep, c


def test_vllm_expert_parallel_placement_is_vllms_expert_map():
    """``vllm_local_experts`` against vLLM's own ``determine_expert_map`` (linear placement),
    uneven splits included."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    for experts, ep in itertools.product((4, 6, 7, 128), (1, 2, 3, 4, 8)):
        if ep > experts:
            continue
        for r in range(ep):
            n, expert_map, _ = determine_expert_map(ep, r, experts)
            local = vl.vllm_local_experts(experts, ep, r)
            want = range(experts) if expert_map is None else [
                e for e in range(experts) if expert_map[e] >= 0
            ]  # fmt: skip
            assert list(local) == list(want) and len(local) == n, (experts, ep, r)
            if expert_map is not None:  # local row j is global expert local[j]
                assert [int(expert_map[e]) for e in local] == list(range(n))


@pytest.mark.parametrize("experts,ep,vtp", [(4, 2, 2), (4, 1, 2), (6, 2, 4), (4, 2, 4)])
def test_moe_plan_into_vllm_expert_parallel(experts, ep, vtp):
    """vLLM with ``enable_expert_parallel``: each vLLM rank gets only its own experts, whole,
    in vLLM's local rows, from the trainer EP rank that owns each; bytes == minimal bytes."""
    spec = moe_spec(experts=experts, moe_ffn=8)
    trainer = mg.MegatronLayout(dp=2 * ep, ep=ep)
    engines = [list(range(e * vtp, (e + 1) * vtp)) for e in range(2 * ep // vtp or 1)]
    plan = build_plan(spec, trainer, vtp, engines, element_size=4, rollout_ep=True)
    got = execute(plan, moe_trainer_state(spec, trainer))
    w = arange_hf(spec)
    read = reader_from_dict(w)
    expert_bytes = 0
    for ranks in engines:
        for r, rank in enumerate(ranks):
            mine = {n: t for (k, n), t in got.items() if k == rank}
            ref = vllm_reference(spec, w, 1, 0)  # whole experts (their TP is 1)
            local = vl.vllm_local_experts(experts, vtp, r)
            fused_got = fused({n: t for n, t in mine.items() if vl.expert_slot(n)})
            for name, t in fused_got.items():
                assert torch.equal(t, ref[name][list(local)]), (rank, name)
                expert_bytes += t.numel() * 4
            assert len(fused_got) == 2 * spec.num_layers, rank
            for lay in vl.rank_shards(spec, vtp, r):  # everything else as without vLLM EP
                if vl.expert_slot(lay.name) is None:
                    assert torch.equal(mine[lay.name], assemble(lay, read, F64)), lay.name
    # every engine receives every expert exactly once, over its ranks
    per_layer = 3 * spec.moe_ffn_hidden_size * spec.hidden_size * 4 * experts
    assert expert_bytes == len(engines) * spec.num_layers * per_layer
    assert plan.minimal_bytes == plan_report(plan).bytes_per_sync


# --- end to end: real policies, real vLLM engines -----------------------------------------

E2E_LAYOUTS = [(1, 1, 2), (1, 1, 1), (2, 1, 1), (1, 2, 1)]  # trainer (tp, pp, ep), world 2
E2E_ROLLOUT_TPS = [1, 2]
E2E_SEQS = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25], [3, 40, 41, 9, 2]]


def _moe_e2e(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    from megatron_grpo.config.schema import ParallelConfig
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.rollout import RolloutEngine

    dist.init_process_group("gloo", rank=rank, world_size=world)
    if rank == 0:
        for v, shape in MOE_VARIANTS.items():
            model_pair(Path(root), v, preset="tiny-moe", **shape)
    dist.barrier()
    out: dict = {}
    for variant, rtp in itertools.product(MOE_VARIANTS, E2E_ROLLOUT_TPS):
        a, b = model_pair(Path(root), variant, preset="tiny-moe", **MOE_VARIANTS[variant])
        spec = load_spec(b)
        # the reference: an engine that loaded checkpoint B itself at start
        eng = RolloutEngine(b, tp=rtp, keep_weight_copies=True, **ENGINE_KW)
        fresh = eng.prompt_logprobs(E2E_SEQS)
        eng.reload_from_hf(b)  # vLLM's own loaders, read back
        ref = eng.export_shards()[0]
        for tp, pp, ep in E2E_LAYOUTS:
            case = f"{variant} train tp{tp} pp{pp} ep{ep} -> rollout tp{rtp}"
            parallel = ParallelConfig(tp=tp, pp=pp, ep=ep, backend="gloo")
            r = sync_b_over_a(eng, a, b, spec, parallel, rtp)
            before, got = r.pop("before"), r.pop("got")
            out[case] = {
                "changed": sorted(n for n, t in ref.items() if not torch.equal(before[n], t)),
                "mismatched": sorted(n for n, t in ref.items() if not torch.equal(got[n], t)),
                "names": sorted(got) == sorted(ref),
                "experts": sum(vl.expert_slot(n) is not None for n in got),
                "logprobs_equal": eng.prompt_logprobs(E2E_SEQS) == fresh,
                **r,
            }
        eng.shutdown()
    dist.barrier()
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_moe_bridge_sync_equals_direct_hf_load(tmp_path: Path, monkeypatch) -> None:
    """After a sync from a trainer at (TP, PP, EP), every vLLM rank (rollout TP 1 or 2)
    holds bit-exactly what vLLM's own loader puts there, scores exactly as an engine started
    from the checkpoint, and the wire carries exactly the plan's minimal bytes; under NCCL's
    point-to-point rules (tests/nccl_rules.py)."""
    monkeypatch.setenv(NCCL_RULES_ENV, "1")
    results = run_distributed(_moe_e2e, 2, str(tmp_path), timeout=850.0)
    assert len(results[0]) == len(MOE_VARIANTS) * len(E2E_LAYOUTS) * len(E2E_ROLLOUT_TPS)
    for rank, res in enumerate(results):
        for case, r in res.items():
            where = f"rank {rank}, {case}"
            assert r["names"] and r["experts"] == 2 * 4 * 2, where  # layers x experts x w13/w2
            assert any(".routed_experts." in n for n in r["changed"]), where
            assert r["mismatched"] == [], f"{where}: {r['mismatched'][:5]}"
            assert r["logprobs_equal"], where
            assert r["bytes"] == r["minimal"], where
            assert r["links"] == r["plan_links"], where


def test_warm_start_writes_experts_in_checkpoint_names(tmp_path: Path) -> None:
    """transformers holds a Qwen3-MoE's experts fused in memory; what the warm start writes
    back must be the per-expert checkpoint tensors that ``save_pretrained`` writes."""
    import transformers
    from safetensors.torch import load_file

    from megatron_grpo.models.prepare import unfuse_experts
    from megatron_grpo.models.tiny import build_hf_model

    out = build_hf_model(tmp_path / "m", preset="tiny-moe", seed=3)
    saved = load_file(str(out / "model.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    state = unfuse_experts(dict(model.state_dict()))
    state.pop("lm_head.weight", None)  # tied
    assert any(".mlp.experts.gate_up_proj" in n for n in model.state_dict())
    assert sorted(state) == sorted(saved)
    assert all(torch.equal(state[n], saved[n]) for n in saved)


def test_preflight_lets_moe_models_train():
    from megatron_grpo.config import Config
    from megatron_grpo.trainer.preflight import check_moe

    check_moe(moe_spec(), Config())  # Qwen3-MoE: the sync carries its experts
    check_moe(moe_spec(shared=8), Config())  # Qwen2-MoE: and the shared expert


def test_plan_counts_experts_by_ep():
    """``megatron-grpo plan``: an EP rank holds num_experts/ep experts of every layer, and the
    sync plan sends the experts a colocated engine lacks from the other EP rank."""
    from megatron_grpo.config.loader import load_config
    from megatron_grpo.dry_run.memory import trainer_params_per_rank

    spec = moe_spec(experts=4, moe_ffn=8)
    per_expert = 3 * spec.moe_ffn_hidden_size * spec.hidden_size
    counts = {}
    for ep in (1, 2):
        cfg = load_config(None, [f"parallel.ep={ep}", "parallel.dp=2", "rollout.tp=1"])
        counts[ep] = trainer_params_per_rank(spec, cfg)
    assert counts[1] - counts[2] == spec.num_layers * 2 * per_expert
