"""The bridge plan, executed in-process by a reference executor on arange-filled shards."""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.bridge.plan import (
    build_plan,
    megatron_rank_order,
    plan_report,
)
from megatron_grpo.layouts import megatron as mg
from megatron_grpo.layouts import vllm as vl
from megatron_grpo.layouts.pieces import assemble, reader_from_dict
from tests.helpers.bridge import check_delivers, execute, placed_engines, trainer_state
from tests.helpers.layouts import arange_hf, make_spec

F64 = torch.float64


SPECS = [
    make_spec("llama", kv=1, tied=False, vocab=77),
    make_spec("qwen2", kv=2, tied=True, vocab=77),
    make_spec("qwen2", kv=1, tied=False, vocab=130),
    make_spec("qwen3", kv=2, tied=False, vocab=129),
    make_spec("qwen3", kv=1, tied=True, vocab=65),
]
IDS = [
    f"{s.family}-kv{s.num_kv_heads}-{'tied' if s.tie_word_embeddings else 'untied'}-v{s.vocab_size}"
    for s in SPECS
]


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2), (2, 1), (2, 2)])
@pytest.mark.parametrize("vtp", [1, 2, 4])
@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_plan_reproduces_vllm_shards(spec, tp, pp, vtp, placement):
    dp = 2
    trainer = mg.MegatronLayout(tp=tp, pp=pp, dp=dp)
    world = tp * pp * dp
    if placement == "colocated" and world % vtp:
        pytest.skip("colocated engines do not tile the trainer world")
    engines = placed_engines(placement, world, vtp)
    plan = build_plan(spec, trainer, vtp, engines, element_size=4)
    expected_bytes = check_delivers(plan, trainer_state(spec, trainer), spec, engines, vtp)
    assert plan.minimal_bytes == expected_bytes
    report = plan_report(plan)
    assert report.bytes_per_sync == expected_bytes
    assert sum(report.bytes_per_link.values()) == expected_bytes
    if placement == "separate":
        # both DP replicas send: no rank is a funnel
        senders = {s for (s, d) in report.bytes_per_link}
        assert len(senders) == world
        assert report.max_sent < 0.75 * expected_bytes


def test_colocated_equal_tp_is_mostly_in_process():
    """Equal TP, ng >= T: every shard has a source in the same process (docs/layouts.md, "The sync plan")."""
    spec = make_spec("qwen2", kv=2, tied=False, vocab=128 * 2)
    trainer = mg.MegatronLayout(tp=2, pp=1, dp=1)
    plan = build_plan(spec, trainer, 2, [[0, 1]])
    report = plan_report(plan)
    # only vocabulary rows differ in split (Megatron pads to 256 per rank, vLLM to 256 total)
    non_vocab = [
        c for c in plan.copies if "embed" not in c.dst_name and "lm_head" not in c.dst_name
    ]
    assert all(c.src_rank == c.dst_rank for c in non_vocab)
    assert report.in_process_bytes > 0.5 * report.bytes_per_sync


def test_vpp_and_te_names_and_custom_rank_table():
    spec = make_spec("qwen3", kv=2, tied=True, vocab=77, layers=4)
    table = {
        (d, p, t): 10 + 4 * d + 2 * p + t for d in range(1) for p in range(2) for t in range(2)
    }
    trainer = mg.MegatronLayout(tp=2, pp=2, vpp=2, dp=1, norm_style="te")
    plan = build_plan(spec, trainer, 2, [[0, 1]], rank_of=table)
    assert any(c.src_name.startswith("chunk1.decoder.layers.") for c in plan.copies)
    assert any("layer_norm_weight" in c.src_name for c in plan.copies)
    got = execute(plan, trainer_state(spec, trainer, table))
    read = reader_from_dict(arange_hf(spec))
    for r in range(2):
        for lay in vl.rank_shards(spec, 2, r):
            assert torch.equal(got[([0, 1][r], lay.name)], assemble(lay, read, F64))
    # tied + PP>1: embedding rows come from stage 0's embedding or the last stage's copy
    emb_srcs = {c.src_name for c in plan.copies if c.dst_name == "model.embed_tokens.weight"}
    assert emb_srcs <= {"chunk0.embedding.word_embeddings.weight", "chunk1.output_layer.weight"}


def test_megatron_rank_order():
    f = megatron_rank_order(tp=2, dp=2, pp=2)
    assert [f(d, p, t) for p in range(2) for d in range(2) for t in range(2)] == list(range(8))


def test_plan_errors():
    spec = make_spec("llama", kv=2)
    with pytest.raises(ValueError, match="rollout tp=2"):
        build_plan(spec, mg.MegatronLayout(), 2, [[0]])
    with pytest.raises(ValueError, match="rollout tp=3"):
        build_plan(spec, mg.MegatronLayout(), 3, [[0, 1, 2]])
