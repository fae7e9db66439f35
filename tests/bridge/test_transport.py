"""The bridge transport against a single-process reference, over spawned gloo processes.

Plans are random but seeded: every process rebuilds the same plan and source shards from
the seed, so nothing but the weights' bytes crosses process boundaries.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from megatron_grpo.bridge.p2p import PlanMismatchError
from megatron_grpo.bridge.plan import Copy, DstTensor, SyncPlan
from megatron_grpo.bridge.schedule import SyncError, build_schedule
from megatron_grpo.bridge.transport import Transport
from tests.helpers.bridge import apply_plan_locally
from tests.helpers.ranks import run_spawned
from tests.nccl_rules import ENV as NCCL_RULES_ENV


@pytest.fixture(params=["gloo", "nccl_rules"])
def p2p_rules(request, monkeypatch) -> str:
    """Spawned ranks run plain gloo, or gloo under NCCL's ordering and waiting rules
    (``tests/nccl_rules.py``): the transport must pass both."""
    if request.param == "nccl_rules":
        monkeypatch.setenv(NCCL_RULES_ENV, "1")
    else:
        monkeypatch.delenv(NCCL_RULES_ENV, raising=False)
    return request.param


# -- random plans ------------------------------------------------------------------------


def random_plan(seed: int, world: int, element_size: int = 4) -> tuple[SyncPlan, dict]:
    """A plan with dim-0 and dim-1 copies, replicated sources, in-process links and
    uncovered (zero) padding rows; returns the plan and ``{rank: {name: shard}}``."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    copies: list[Copy] = []
    dsts: list[DstTensor] = []
    sources: dict[int, dict[str, torch.Tensor]] = {r: {} for r in range(world)}
    n_src = 0
    for t in range(rng.randint(4, 9)):
        dst_rank = rng.randrange(world)
        if rng.random() < 0.2:
            shape: tuple[int, ...] = (rng.randint(3, 40),)
            dim = 0
        else:
            shape = (rng.randint(2, 30), rng.randint(2, 30))
            dim = rng.randrange(2)
        name = f"model.layers.{t}.w"
        dsts.append(DstTensor(dst_rank, name, shape))
        pos = 0
        while pos < shape[dim]:
            length = rng.randint(1, shape[dim] - pos)
            if rng.random() < 0.2:  # leave padding rows that no copy writes
                pos += length
                continue
            src_rank = rng.randrange(world)
            offset = rng.randint(0, 3)
            src_shape = list(shape)
            src_shape[dim] = offset + length + rng.randint(0, 3)
            src_name = f"decoder.src{n_src}"
            n_src += 1
            sources[src_rank][src_name] = torch.randn(src_shape, generator=gen)
            copies.append(Copy(src_rank, src_name, dst_rank, name, dim, offset, pos, length))
            # The same source slice replicated to another rank (k/v heads with rollout TP
            # above the KV-head count, norms).
            if rng.random() < 0.3:
                other = rng.randrange(world)
                rname = f"{name}.replica{n_src}"
                dsts.append(DstTensor(other, rname, shape))
                copies.append(Copy(src_rank, src_name, other, rname, dim, offset, pos, length))
            pos += length
    rng.shuffle(copies)
    return SyncPlan(copies=copies, dst_tensors=dsts, element_size=element_size), sources


def _second_sync_sources(sources: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # New values on the second sync: stale bucket contents would show up as a mismatch.
    return {k: v * 3.0 + 1.0 for k, v in sources.items()}


# -- single process ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("bucket_bytes", [4, 64, 1000, 1 << 20])
def test_schedule_covers_every_copy_once_within_bucket_size(seed: int, bucket_bytes: int) -> None:
    plan, _ = random_plan(seed, world=3)
    schedule = build_schedule(plan, bucket_bytes)
    shapes = {(d.rank, d.name): d.shape for d in plan.dst_tensors}
    for (src, dst), buckets in schedule.items():
        assert src != dst
        covered: dict[tuple[str, str], int] = {}
        for i, b in enumerate(buckets):
            assert b.index == i
            assert b.numel == sum(e.numel for e in b.entries)
            offset = 0
            for e in b.entries:
                assert e.offset == offset
                offset += e.numel
                key = (e.copy.src_name, e.copy.dst_name)
                covered[key] = covered.get(key, 0) + e.copy.length
            # Only a single row larger than a bucket may exceed the bucket size.
            row = max(e.numel // e.copy.length for e in b.entries)
            assert b.numel * plan.element_size <= max(bucket_bytes, row * plan.element_size)
        expect = {}
        for c in plan.copies:
            if (c.src_rank, c.dst_rank) == (src, dst):
                expect[(c.src_name, c.dst_name)] = (
                    expect.get((c.src_name, c.dst_name), 0) + c.length
                )
                assert (c.dst_rank, c.dst_name) in shapes
        assert covered == expect


def test_single_rank_colocated_sync_needs_no_process_group() -> None:
    plan, sources = random_plan(11, world=1)
    got: dict[str, torch.Tensor] = {}
    tr = Transport(plan, 0, bucket_mb=0.001, timeout_s=5)
    st, built = tr.run_plan(sources[0], deliver=lambda n, t: got.__setitem__(n, t.clone()))
    ref = apply_plan_locally(plan, sources)
    assert set(got) == {d.name for d in plan.dst_tensors}
    for name, t in got.items():
        assert torch.equal(t, ref[(0, name)]), name
    assert st.bytes_local == plan.minimal_bytes and st.bytes_sent == 0
    parts = st.breakdown()
    assert list(parts) == [
        "handshake", "pack", "transfer", "unpack", "vllm_load", "vllm_post", "cache_reset", "other"
    ]  # fmt: skip
    assert all(v >= 0 for v in parts.values())
    assert sum(parts.values()) == pytest.approx(st.total_s)
    assert parts["vllm_load"] == pytest.approx(st.load_s)  # ``deliver``, nothing else of vLLM's


def test_reference_executor_leaves_padding_zero() -> None:
    plan = SyncPlan(
        copies=[Copy(0, "emb", 0, "embed_tokens", 0, 2, 0, 3)],
        dst_tensors=[DstTensor(0, "embed_tokens", (5, 2))],
    )
    src = torch.arange(12, dtype=torch.float32).view(6, 2)
    out = apply_plan_locally(plan, {0: {"emb": src}})[(0, "embed_tokens")]
    assert torch.equal(out[:3], src[2:5]) and torch.equal(out[3:], torch.zeros(2, 2))


def _pack_unpack_every_link(plan: SyncPlan, sources: dict, bucket_mb: float, dtype) -> dict:
    """Every network link's buckets packed by its sender's ``packer.pack`` and unpacked by
    its receiver's ``packer.unpack``, in one process (what ``Transport.run_plan`` does around the
    wire); returns ``{(rank, name): shard}`` of what the links deliver, zero elsewhere."""
    ranks = {d.rank for d in plan.dst_tensors} | {c.src_rank for c in plan.copies}
    tr = {r: Transport(plan, r, bucket_mb=bucket_mb, dtype=dtype) for r in ranks}
    out = {(d.rank, d.name): torch.zeros(d.shape, dtype=dtype) for d in plan.dst_tensors}
    for (src, dst), buckets in tr[0].schedule.items():
        buf = torch.full((max(b.numel for b in buckets),), float("nan"), dtype=dtype)
        for b in buckets:
            flat = tr[src].packer.pack(sources[src], b, buf)
            assert flat.numel() == b.numel and flat.data_ptr() == buf.data_ptr()
            tr[dst].packer.unpack(b, buf, lambda name, dst=dst: out[(dst, name)])
    return out


def _network_reference(plan: SyncPlan, sources: dict, dtype) -> dict:
    remote = [c for c in plan.copies if c.src_rank != c.dst_rank]
    return apply_plan_locally(SyncPlan(remote, plan.dst_tensors, plan.element_size), sources, dtype)


def _odd_strides(sources: dict, every: int) -> dict:
    """The same values, every ``every``-th 2-D shard held transposed (non-contiguous)."""
    out = {}
    for r, shards in sources.items():
        out[r] = {}
        for k, (name, t) in enumerate(sorted(shards.items())):
            odd = t.dim() == 2 and k % every == 0
            out[r][name] = t.t().contiguous().t() if odd else t
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("bucket_mb", [0.0002, 64.0])
@pytest.mark.parametrize("element_size", [4, 2])
def test_pack_unpack_reproduce_reference_on_random_plans(seed, bucket_mb, element_size) -> None:
    # fp32 shards, some non-contiguous, some float64: bf16 (element_size 2) or fp32 on the wire.
    plan, sources = random_plan(seed, world=3, element_size=element_size)
    sources = _odd_strides(sources, every=2)
    for r in sources:
        for k, name in enumerate(sorted(sources[r])):
            if k % 3 == 1:
                sources[r][name] = sources[r][name].double()
    dtype = torch.float32 if element_size == 4 else torch.bfloat16
    got = _pack_unpack_every_link(plan, sources, bucket_mb, dtype)
    ref = _network_reference(plan, sources, dtype)
    for key, t in ref.items():
        assert torch.equal(got[key], t), key


def _real_layout_cases():
    from megatron_grpo.layouts.megatron import MegatronLayout
    from tests.helpers.layouts import make_spec

    # (spec, trainer layout, rollout tp, engines): equal TP; TP=2 -> two TP=1 engines (the
    # GPU suite's bandwidth case: qkv/gate-up merge into one run per shard on the sender);
    # TP=1 -> TP=2 (dim-1 halves of row-parallel weights: strided sources); PP=2.
    spec = make_spec("qwen2", kv=2, tied=True, vocab=77)
    spec3 = make_spec("qwen3", kv=1, tied=False, vocab=129)
    return [
        (spec, MegatronLayout(tp=2, pp=1, dp=1), 2, [[2, 3]]),
        (spec, MegatronLayout(tp=2, pp=1, dp=1), 1, [[0], [1]]),
        (spec, MegatronLayout(tp=1, pp=1, dp=1), 2, [[1, 2]]),
        (spec3, MegatronLayout(tp=2, pp=2, dp=1), 2, [[4, 5]]),
    ]


@pytest.mark.parametrize("case", range(4))
@pytest.mark.parametrize("bucket_mb", [0.0005, 64.0])
def test_pack_unpack_reproduce_reference_on_model_plans(case, bucket_mb) -> None:
    from megatron_grpo.bridge.plan import build_plan
    from tests.helpers.bridge import trainer_state

    spec, layout, vtp, engines = _real_layout_cases()[case]
    plan = build_plan(spec, layout, vtp, engines, element_size=8)
    state = trainer_state(spec, layout)  # arange-filled float64: a misplaced slice shows
    sources: dict[int, dict[str, torch.Tensor]] = {}
    for (rank, name), t in state.items():
        sources.setdefault(rank, {})[name] = t
    got = _pack_unpack_every_link(plan, _odd_strides(sources, every=3), bucket_mb, torch.float64)
    ref = _network_reference(plan, sources, torch.float64)
    assert any(c.src_rank != c.dst_rank for c in plan.copies)
    for key, t in ref.items():
        assert torch.equal(got[key], t), key


def test_runs_merge_only_what_is_contiguous_on_their_side() -> None:
    # Source rows 0..5 of "a" go to three places of "x" (q, k, v of one group): one run on
    # the sender, three on the receiver. Dim-1 slices of "b" (4 rows) do not merge; dim-1
    # slices of "c" (1 row) do.
    plan = SyncPlan(
        copies=[
            Copy(0, "a", 1, "x", 0, 0, 0, 2),
            Copy(0, "a", 1, "x", 0, 2, 4, 2),
            Copy(0, "a", 1, "x", 0, 4, 8, 2),
            Copy(0, "b", 1, "y", 1, 0, 0, 3),
            Copy(0, "b", 1, "y", 1, 3, 3, 3),
            Copy(0, "c", 1, "z", 1, 0, 0, 3),
            Copy(0, "c", 1, "z", 1, 3, 3, 3),
        ],
        dst_tensors=[
            DstTensor(1, "x", (10, 5)), DstTensor(1, "y", (4, 6)), DstTensor(1, "z", (1, 6)),
        ],
    )  # fmt: skip
    (bucket,) = build_schedule(plan, 1 << 20)[(0, 1)]
    src_runs = [(r.name, r.dim, r.start, r.length, r.shape) for r in bucket.pack_runs]
    assert src_runs == [
        ("a", 0, 0, 6, (6, 5)),
        ("b", 1, 0, 3, (4, 3)),
        ("b", 1, 3, 3, (4, 3)),
        ("c", 1, 0, 6, (1, 6)),
    ]
    dst_runs = [(r.name, r.start, r.length) for r in bucket.unpack_runs]
    assert dst_runs == [
        ("x", 0, 2),
        ("x", 4, 2),
        ("x", 8, 2),
        ("y", 0, 3),
        ("y", 3, 3),
        ("z", 0, 6),
    ]
    for runs in (bucket.pack_runs, bucket.unpack_runs):  # runs tile the bucket in order
        assert [r.offset for r in runs] == [
            sum(q.numel for q in runs[:i]) for i in range(len(runs))
        ]
        assert sum(r.numel for r in runs) == bucket.numel
    assert dict(bucket.dst_counts) == {"x": 3, "y": 2, "z": 2}
    sources = {0: {"a": torch.randn(6, 5), "b": torch.randn(4, 6), "c": torch.randn(1, 6)}}
    got = _pack_unpack_every_link(plan, sources, 1.0, torch.float32)
    ref = apply_plan_locally(plan, sources)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


# -- spawned gloo processes --------------------------------------------------------------


# (world, seed, bucket_mb, element_size): one bucket per link; ~200-byte buckets that split
# copies across many buckets; 3 and 4 ranks; bf16 on the wire from fp32 shards.
REFERENCE_CASES = [
    (2, 0, 64.0, 4),
    (2, 1, 0.0002, 4),
    (3, 2, 0.001, 4),
    (4, 3, 0.0005, 4),
    (4, 4, 0.002, 2),
]


def _run_random_plans(rank: int, world: int, cases: list) -> list[dict]:
    # All cases in one process group (ranks a plan does not name skip its sync): process
    # start-up, not the transfers, dominates on 2 cores.
    out = []
    for case_world, seed, bucket_mb, element_size in cases:
        plan, sources = random_plan(seed, case_world, element_size)
        res: dict = {"stats": [], "dst": []}
        if rank < case_world:
            tr = Transport(plan, rank, bucket_mb=bucket_mb, timeout_s=30)
            for src in (sources[rank], _second_sync_sources(sources[rank])):
                got: dict[str, torch.Tensor] = {}

                def deliver(name: str, t: torch.Tensor, got=got) -> None:
                    assert name not in got, f"{name} delivered twice"
                    got[name] = t.clone()

                st, _ = tr.run_plan(src, deliver=deliver, finish=lambda: None)
                res["stats"].append(st.to_dict())
                res["dst"].append(got)
        out.append(res)
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_transport_reproduces_reference(p2p_rules: str) -> None:
    world = max(c[0] for c in REFERENCE_CASES)
    results = run_spawned(_run_random_plans, world, args=(REFERENCE_CASES,), timeout_s=200)
    for k, (case_world, seed, _bucket_mb, element_size) in enumerate(REFERENCE_CASES):
        case = f"case {REFERENCE_CASES[k]}"
        plan, sources = random_plan(seed, case_world, element_size)
        dtype = torch.float32 if element_size == 4 else torch.bfloat16
        second = {r: _second_sync_sources(s) for r, s in sources.items()}
        for i, per_rank_src in enumerate((sources, second)):
            ref = apply_plan_locally(plan, per_rank_src, dtype=dtype)
            for rank in range(case_world):
                got = results[rank][k]["dst"][i]
                assert set(got) == {d.name for d in plan.dst_tensors if d.rank == rank}, case
                for name, t in got.items():
                    assert t.dtype == dtype
                    assert torch.equal(t, ref[(rank, name)]), f"{case} sync {i} rank {rank} {name}"
            stats = [results[r][k]["stats"][i] for r in range(case_world)]
            moved = sum(s["bytes_sent"] + s["bytes_local"] for s in stats)
            assert moved == plan.minimal_bytes, case
            assert sum(s["bytes_received"] for s in stats) == sum(s["bytes_sent"] for s in stats)
            per_link: dict[str, int] = {}
            for s in stats:
                for key, v in s["bytes_per_link"].items():
                    per_link[key] = per_link.get(key, 0) + v
            assert per_link == {f"{a}->{b}": n for (a, b), n in plan.bytes_per_link().items()}
        # The plan handshake runs on the first sync only.
        assert all(results[r][k]["stats"][1]["handshake_s"] == 0 for r in range(case_world))


def _two_way_plan() -> SyncPlan:
    # Every rank sends to and receives from every other rank.
    copies, dsts = [], []
    for s in range(3):
        for d in range(3):
            dsts.append(DstTensor(d, f"w{s}{d}", (8, 4)))
            copies.append(Copy(s, "w", d, f"w{s}{d}", 0, 0, 0, 8))
    return SyncPlan(copies=copies, dst_tensors=dsts)


def _run_with_absent_peer(rank: int, world: int, timeout_s: float) -> dict:
    plan = _two_way_plan()
    if rank == 2:  # joined the process group but never calls sync
        time.sleep(timeout_s * 3)
        return {"absent": True}
    tr = Transport(plan, rank, timeout_s=timeout_s)
    t0 = time.perf_counter()
    try:
        tr.run_plan({"w": torch.ones(8, 4)})
    except SyncError as exc:
        return {"error": str(exc), "type": type(exc).__name__, "elapsed": time.perf_counter() - t0}
    return {"error": None}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_absent_peer_raises_sync_error_naming_it(p2p_rules: str) -> None:
    timeout_s = 3.0
    results = run_spawned(_run_with_absent_peer, 3, args=(timeout_s,), timeout_s=90)
    for rank in (0, 1):
        r = results[rank]
        assert r["error"] is not None, f"rank {rank} finished a sync with a peer missing"
        assert r["type"] == "SyncError"
        assert "rank 2" in r["error"] and "sync.timeout_s" in r["error"], r["error"]
        # Figures, not assertions on speed: the error came after the timeout, well before
        # the absent peer woke up.
        assert r["elapsed"] < timeout_s * 3


def _run_mismatched(rank: int, world: int, kind: str) -> dict:
    plan = _two_way_plan()
    bucket_mb = 64.0
    if rank == 1 and kind == "bucket":
        bucket_mb = 32.0
    if rank == 1 and kind == "plan":
        c = plan.copies[1]  # 0 -> 1: rank 1 expects 6 rows instead of 8
        plan.copies[1] = Copy(c.src_rank, c.src_name, c.dst_rank, c.dst_name, 0, 0, 0, 6)
    tr = Transport(plan, rank, bucket_mb=bucket_mb, timeout_s=20)
    try:
        tr.run_plan({"w": torch.ones(8, 4)})
    except SyncError as exc:
        return {"error": str(exc), "type": type(exc).__name__}
    return {"error": None}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,needle", [("bucket", "sync.bucket_mb"), ("plan", "fingerprint")])
def test_mismatched_plans_raise_before_any_weight_moves(
    kind: str, needle: str, p2p_rules: str
) -> None:
    results = run_spawned(_run_mismatched, 3, args=(kind,), timeout_s=90)
    for rank in (0, 1):
        r = results[rank]
        assert r["type"] == "PlanMismatchError", r
        assert needle in r["error"] and "different sync plans" in r["error"], r["error"]
    assert PlanMismatchError.__mro__[1] is SyncError
    # Rank 2's links are consistent; it either finished or saw its peers fail.
    assert results[2]["error"] is None or "rank" in results[2]["error"]
