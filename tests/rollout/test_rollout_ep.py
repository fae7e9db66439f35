"""``rollout.expert_parallel`` (vLLM's expert parallelism): the refusals, the plan inputs
both ends of a sync rebuild the plan from, and what ``megatron-grpo plan`` counts. CPU, no
engine: vLLM's CPU MoE kernel cannot run EP (docs/moe.md, "vLLM expert parallelism")."""

from __future__ import annotations

import json
import math

import pytest

from megatron_grpo.bridge.plan import build_plan, plan_report
from megatron_grpo.bridge.transfer_group import PlanInputs
from megatron_grpo.config import ConfigError, load_config
from megatron_grpo.dry_run import build_launch_plan
from megatron_grpo.layouts import megatron as mg
from megatron_grpo.layouts import vllm as vl
from megatron_grpo.models.shapes import resolve_spec
from megatron_grpo.trainer.preflight import check_moe
from tests.helpers.layouts import moe_spec

EP = ["rollout.expert_parallel=true", "rollout.tp=2", "parallel.dp=2"]


def test_expert_parallel_needs_more_than_one_vllm_rank():
    with pytest.raises(ConfigError, match=r"rollout.expert_parallel=true with rollout.tp=1"):
        load_config(None, ["rollout.expert_parallel=true"])
    assert load_config(None, EP).rollout.expert_parallel is True


def test_expert_parallel_refusals():
    cfg = load_config(None, EP)
    dense = resolve_spec("tiny")[0]
    with pytest.raises(ConfigError, match=r"needs a mixture-of-experts model.*tiny is dense"):
        check_moe(dense, cfg, has_cuda=True)
    with pytest.raises(ConfigError, match=r"needs a GPU: vLLM's CPU MoE kernel ignores"):
        check_moe(moe_spec(), cfg, has_cuda=False)
    wide = load_config(None, ["rollout.expert_parallel=true", "rollout.tp=4", "parallel.dp=4"])
    with pytest.raises(ConfigError, match=r"num_experts=2 < rollout tp=4"):
        check_moe(moe_spec(experts=2), wide, has_cuda=True)
    # whole experts on each vLLM rank: their width need not split over rollout.tp
    check_moe(moe_spec(experts=4, moe_ffn=6), wide, has_cuda=True)
    with pytest.raises(ConfigError, match=r"moe_intermediate_size\(6\)"):
        check_moe(moe_spec(experts=4, moe_ffn=6), load_config(None, ["rollout.tp=4"]))


def test_plan_inputs_carry_expert_parallel_to_the_receiver():
    """The receiver rebuilds the plan from ``PlanInputs``' dict (sent as JSON): the flag
    survives, and the plan is ``build_plan(rollout_ep=True)``'s, not the TP plan."""
    spec = moe_spec(experts=4, moe_ffn=8)
    trainer = mg.MegatronLayout(dp=2, ep=2)
    engines = [[0, 1]]
    sent = PlanInputs("unused", trainer, 2, engines, "float32", 1.0, 60.0, rollout_ep=True)
    got = PlanInputs.from_dict(json.loads(json.dumps(sent.to_dict())))
    assert got == sent and got.rollout_ep
    plan = got.build(spec)
    want = build_plan(spec, trainer, 2, engines, element_size=4, rollout_ep=True)
    assert plan.copies == want.copies and plan.dst_tensors == want.dst_tensors
    tp_plan = build_plan(spec, trainer, 2, engines, element_size=4)
    assert plan.dst_tensors != tp_plan.dst_tensors
    old = {k: v for k, v in sent.to_dict().items() if k != "rollout_ep"}  # a dict without it
    assert PlanInputs.from_dict(old).rollout_ep is False


def test_plan_counts_whole_local_experts():
    """``megatron-grpo plan``: vLLM's weights per rank are its ``rank_shards`` with whole
    local experts (6 experts over 4 ranks: 2, 2, 1, 1), and the sync plan is the EP plan."""
    spec = moe_spec(experts=6, moe_ffn=8)
    cfg = load_config(None, ["rollout.expert_parallel=true", "rollout.tp=4", "parallel.dp=4"])
    lp = build_launch_plan(cfg, spec, nodes=1, gpus_per_node=4)
    elem = 2  # bf16 on GPU
    per_rank = [
        sum(elem * math.prod(s.shape) for s in vl.rank_shards(spec, 4, r, True)) for r in range(4)
    ]
    assert per_rank[0] > per_rank[3]
    assert lp.memory.peak.components["vllm_weights"] == max(per_rank)
    trainer = mg.MegatronLayout(1, 1, 1, 4, padded_vocab=lp.spec.vocab_size)
    want = plan_report(build_plan(spec, trainer, 4, lp.ranks.engines, elem, rollout_ep=True))
    assert lp.sync == want  # (vLLM's vocabulary padding rows get no copy)
    tp_plan = build_plan(spec, trainer, 4, lp.ranks.engines, elem)
    assert want.num_dst_tensors != plan_report(tp_plan).num_dst_tensors
