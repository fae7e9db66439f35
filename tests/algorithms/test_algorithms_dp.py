"""Global normalizers over a real gloo data-parallel group (2 spawned CPU processes)."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from megatron_grpo.algorithms import aggregation as agg
from megatron_grpo.config.schema import GRPOConfig
from tests.helpers.batches import loss_batch
from tests.helpers.configs import grpo_config

B, T = 6, 5


def _batch() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The current policy's log-probs and the loss's inputs by field."""
    g = torch.Generator().manual_seed(7)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    mask[4] = 0  # a fully masked sequence on rank 1: must not count as a sequence
    return logp, {
        "loss_mask": mask,
        "advantages": torch.randn(B, generator=g, dtype=torch.float64),
        "alpha_engine_logp": logp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64),
        "pi_ref_logp": logp - 0.3,
    }


def _cfg(loss_agg: str) -> GRPOConfig:
    return grpo_config(loss_agg=loss_agg, kl_coef=0.1, loss_agg_constant=5.0)


MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")


def _worker(rank: int, world: int, init_file: str, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        logp, full = _batch()
        # Rank 0 holds rows 0..1 (one micro-batch), rank 1 rows 2..5 (two micro-batches).
        mbs = [[(0, 2)], [(2, 3), (3, 6)]][rank]
        norms = agg.compute_global_normalizers(
            [full["loss_mask"][a:c] for a, c in mbs], group=dist.group.WORLD
        )
        batch = loss_batch(**full, normalizers=norms)
        totals = torch.zeros(len(MODES), dtype=torch.float64)
        for i, mode in enumerate(MODES):
            loss_fn = agg.make_loss_fn(_cfg(mode))
            for a, c in mbs:
                mb = batch.select(slice(a, c))
                totals[i] += loss_fn(logp[a:c], torch.zeros(c - a, T), mb)[0]
        dist.all_reduce(totals)
        if rank == 0:
            out.put((totals.tolist(), norms.num_seqs.item()))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_gloo_dp_sum_equals_full_batch(tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init_file = os.path.join(tmp_path, "pg_init")
    procs = [ctx.Process(target=_worker, args=(r, 2, init_file, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        totals, num_seqs = out.get(timeout=100)
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    logp, full = _batch()
    mb = loss_batch(**full)  # the whole batch's normalizers, on one rank
    assert num_seqs == mb.normalizers.num_seqs.item() == 5
    for mode, total in zip(MODES, totals):
        whole = agg.make_loss_fn(_cfg(mode))(logp, torch.zeros(B, T), mb)[0]
        assert total == pytest.approx(whole.item(), rel=1e-6), mode
