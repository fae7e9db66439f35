"""End to end: after a bridge sync, every vLLM rank holds exactly what it holds after
loading the HF checkpoint directly.

Real pieces only: megatron-core policies built from HF checkpoint B at trainer (TP, PP) in
{1,2}x{1,2} (DP fills the 4 ranks), colocated vLLM engines (external_launcher) of rollout
TP in {1,2} started from a different checkpoint A, the plan from ``bridge.plan``, the
trainer's colocated ``WeightSender`` (transport + ``ShardReceiver`` sink inside vLLM's
reload protocol). Reference: the same engine after ``reload_from_hf(B)`` (vLLM's own loader),
read back with ``export_shards``. Every comparison is bit-exact.

One spawned group of 4 ranks runs every case (process and engine start-up dominate on 2
cores): per (variant, rollout TP) one engine, per trainer layout a re-initialised Megatron.
It runs under NCCL's rules emulated over gloo (``tests/nccl_rules.py``: per-peer in-order
point-to-point, NCCL's ``Work.wait`` semantics, the devices each group serves on GPU),
which is stricter than plain gloo; the transport's own tests cover plain gloo too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist_utils import run_distributed
from tests.helpers.bridge import ENGINE_KW, model_pair, sync_b_over_a
from tests.nccl_rules import ENV as NCCL_RULES_ENV

pytestmark = pytest.mark.slow

VARIANTS = {
    "qwen2_tied": dict(),
    "llama_kv1_untied": dict(
        architecture="LlamaForCausalLM", num_key_value_heads=1, tie_word_embeddings=False
    ),
    "qwen3_qknorm_untied": dict(architecture="Qwen3ForCausalLM", tie_word_embeddings=False),
}
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
ROLLOUT_TPS = [1, 2]


def _e2e(rank: int, world: int, root: str) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_grpo.config.schema import ParallelConfig
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.rollout import RolloutEngine

    dist.init_process_group("gloo", rank=rank, world_size=world)
    if rank == 0:
        for v, shape in VARIANTS.items():
            model_pair(Path(root), v, **shape)
    dist.barrier()
    out: dict = {}
    for variant, shape in VARIANTS.items():
        a, b = model_pair(Path(root), variant, **shape)
        spec = load_spec(b)
        for rtp in ROLLOUT_TPS:
            eng = RolloutEngine(a, tp=rtp, keep_weight_copies=True, **ENGINE_KW)
            eng.reload_from_hf(b)
            ref = eng.export_shards()[0]
            for tp, pp in LAYOUTS:
                case = f"{variant} train tp{tp} pp{pp} -> rollout tp{rtp}"
                parallel = ParallelConfig(tp=tp, pp=pp, backend="gloo")
                r = sync_b_over_a(eng, a, b, spec, parallel, rtp)
                before, got = r.pop("before"), r.pop("got")
                out[case] = {
                    "changed": any(not torch.equal(before[n], t) for n, t in ref.items()),
                    "mismatched": sorted(n for n, t in ref.items() if not torch.equal(got[n], t)),
                    "names_equal": set(got) == set(ref),
                    **r,
                }
            eng.shutdown()
    dist.barrier()
    return out


@pytest.mark.timeout(900)
def test_bridge_sync_equals_direct_hf_load(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(NCCL_RULES_ENV, "1")
    results = run_distributed(_e2e, 4, str(tmp_path), timeout=850.0)
    cases = results[0].keys()
    assert len(cases) == len(VARIANTS) * len(ROLLOUT_TPS) * len(LAYOUTS)
    for rank, res in enumerate(results):
        for case, r in res.items():
            where = f"rank {rank}, {case}"
            assert r["names_equal"], where
            assert r["changed"], f"{where}: checkpoints A and B do not differ"
            assert r["mismatched"] == [], f"{where}: {r['mismatched'][:5]}"
            assert r["bytes"] == r["minimal"], where
            assert r["links"] == r["plan_links"], where
