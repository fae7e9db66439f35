"""validate_parallel's messages (pure) and init_distributed over spawned gloo ranks."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_grpo.config.schema import ConfigError, ParallelConfig
from megatron_grpo.distributed import validate_parallel
from megatron_grpo.models.spec import ModelSpec, spec_from_hf_config
from megatron_grpo.models.tiny import hf_config_dict
from tests.dist_utils import run_distributed


def make_spec(**kw) -> ModelSpec:
    """The tiny preset at 4 layers and 100 tokens (heads 4, KV heads 2, ffn 256), with the
    ModelSpec fields ``kw`` replaced."""
    tiny = spec_from_hf_config(hf_config_dict("tiny", vocab_size=100, num_hidden_layers=4))
    return dataclasses.replace(tiny, **kw)


def test_dp_derived_and_explicit():
    assert validate_parallel(ParallelConfig(tp=2, pp=2), 8, make_spec(), has_cuda=False) == 2
    assert validate_parallel(ParallelConfig(tp=2, pp=2, dp=2), 8, has_cuda=False) == 2
    assert validate_parallel(ParallelConfig(), 1, make_spec(), has_cuda=False) == 1


@pytest.mark.parametrize(
    "cfg, world, spec_kw, message",
    [
        (
            dict(tp=2, pp=2, dp=1),
            8,
            {},
            "tp(2)*pp(2)*dp(1)=4 != WORLD_SIZE(8): set parallel.dp=2 or launch 4 processes.",
        ),
        (
            dict(tp=4, pp=1, dp=1),
            6,
            {},
            "tp(4)*pp(1)*dp(1)=4 != WORLD_SIZE(6): launch 4 processes.",
        ),
        (
            dict(tp=4, pp=1),
            6,
            {},
            "tp(4)*pp(1)=4 does not divide WORLD_SIZE(6): launch a multiple of 4 processes",
        ),
        (
            dict(tp=8),
            8,
            {},
            "num_heads(4) is not divisible by parallel.tp(8): every TP rank holds num_heads/tp "
            "attention heads; choose parallel.tp from [1, 2, 4].",
        ),
        (
            dict(tp=4),
            4,
            dict(num_heads=12, num_kv_heads=6),
            "num_kv_heads(6) is not divisible by parallel.tp(4)",
        ),
        (
            dict(tp=4),
            4,
            dict(num_heads=12, num_kv_heads=3, head_dim=32),
            "parallel.tp(4) > num_kv_heads(3) needs tp to be a multiple of num_kv_heads",
        ),
        (
            dict(tp=2),
            2,
            dict(ffn_hidden_size=255),
            "ffn_hidden_size(255) is not divisible by parallel.tp(2)",
        ),
        (
            dict(pp=3),
            3,
            {},
            "num_layers(4) is not divisible by parallel.pp(3): every pipeline stage holds the same "
            "number of layers; choose parallel.pp from [1, 2, 4].",
        ),
        (dict(pp=2, vpp=4), 2, {}, "num_layers(4) is not divisible by pp(2)*vpp(4)=8"),
        (dict(backend="nccl"), 1, {}, "parallel.backend='nccl' needs CUDA"),
    ],
)
def test_bad_layout_is_refused_naming_the_values_and_the_fix(cfg, world, spec_kw, message):
    with pytest.raises(ConfigError) as err:
        validate_parallel(ParallelConfig(**cfg), world, make_spec(**spec_kw), has_cuda=False)
    assert message in str(err.value)


def test_fewer_query_groups_than_tp_is_allowed():
    # megatron/core/transformer/attention.py all-gathers the fused QKV when ng < tp.
    spec = make_spec(num_heads=4, num_kv_heads=1)
    assert validate_parallel(ParallelConfig(tp=2), 2, spec, has_cuda=False) == 1


def test_sequence_parallelism_passes_with_and_without_cuda():
    cfg = ParallelConfig(tp=2, sequence_parallel=True)  # the local spec's norms take it
    for cuda in (True, False):
        assert validate_parallel(cfg, 2, make_spec(), has_cuda=cuda) == 1


def _init_worker(rank, world_size):
    import torch.distributed as dist

    from megatron_grpo.distributed import destroy_distributed, init_distributed

    ctx = init_distributed(ParallelConfig(tp=2, pp=2, timeout_s=60), make_spec())
    out = dict(
        rank=ctx.rank,
        world=ctx.world_size,
        tp=ctx.tp,
        pp=ctx.pp,
        dp=ctx.dp,
        tp_rank=ctx.tp_rank,
        pp_rank=ctx.pp_rank,
        dp_rank=ctx.dp_rank,
        backend=ctx.backend,
        device=str(ctx.device),
        last=ctx.last_stage_rank,
        is_last=ctx.is_last_stage,
        tp_ranks=dist.get_process_group_ranks(ctx.tp_group),
        pp_ranks=dist.get_process_group_ranks(ctx.pp_group),
    )
    destroy_distributed()
    out["destroyed"] = not dist.is_initialized()
    destroy_distributed()  # safe twice
    return out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_init_distributed_tp2_pp2():
    res = run_distributed(_init_worker, 4, timeout=150)
    for r, out in enumerate(res):
        assert out["rank"] == r and out["world"] == 4 and out["dp"] == 1
        assert out["backend"] == "gloo" and out["device"] == "cpu"
        # megatron's tp-cp-ep-dp-pp order: TP ranks adjacent, PP the slowest axis
        assert out["tp_rank"] == r % 2 and out["pp_rank"] == r // 2
        assert out["tp_ranks"] == [r - r % 2, r - r % 2 + 1]
        assert out["pp_ranks"] == [r % 2, r % 2 + 2]
        assert out["last"] == r % 2 + 2 and out["is_last"] == (r >= 2)
        assert out["destroyed"]


def test_the_attempt_is_agreed_job_wide_whatever_each_node_counted(monkeypatch):
    """Across nodes only the failing node's torchrun counts a restart: the restarted ranks of
    two nodes start with different TORCHELASTIC_RESTART_COUNTs, and still agree one attempt
    (and so one store prefix) through the store that outlives them; an answer an earlier
    attempt left in it is never read as this one's."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from datetime import timedelta

    import torch.distributed as dist

    from megatron_grpo.distributed import setup

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    counts: dict[int, int] = {}  # rank -> its node's restart count
    local = threading.local()  # the rank of the thread that plays it
    monkeypatch.setattr(setup, "node_restart_count", lambda: counts[local.rank])

    def start(rank: int) -> int:
        local.rank = rank
        return setup._agree_attempt(store, rank, 3)

    def attempt(node_counts: dict[int, int]) -> list[int]:
        counts.update(node_counts)
        with ThreadPoolExecutor(3) as pool:
            return list(pool.map(start, [2, 1, 0]))  # rank 0 last: others' hellos wait

    assert attempt({0: 0, 1: 0, 2: 0}) == [0, 0, 0]
    assert attempt({0: 0, 1: 1, 2: 1}) == [1, 1, 1]  # node 1 (ranks 1, 2) failed
    assert attempt({0: 1, 1: 1, 2: 1}) == [2, 2, 2]  # then node 0
    assert attempt({0: 5, 1: 1, 2: 1}) == [5, 5, 5]  # node 0 failed before the store, thrice
