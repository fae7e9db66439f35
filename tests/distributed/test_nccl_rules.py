"""NCCL's rules, emulated over gloo (``tests/nccl_rules.py``): the emulation has teeth, and the
trainer's collective call sites and the raw yardstick obey it.

- Point to point: two ranks that each post "receive from the other" before "send to the
  other", ungrouped, deadlock under the emulation (as under NCCL) while plain gloo lets
  them through; the same exchange ordered by rank, or grouped with ``batch_isend_irecv``,
  completes. ``bench.raw.RawTransfer`` (every rank sends to and receives from every other)
  completes under it. The bridge transport's own tests run under it too
  (``tests/bridge/test_transport.py``, ``p2p_rules`` fixture).
- Devices: with the groups created as the GPU run creates them, every collective the
  trainer issues on CPU tensors (``Preemption.agreed``, ``compute_global_normalizers``,
  ``dp_logprobs``) must be served. Under the old rule (every group ``nccl``) each of them
  raises, which is what a first multi-rank GPU run hit.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from megatron_grpo.algorithms.step_batch import Normalizers
from tests.dist_utils import run_distributed
from tests.helpers.ranks import run_spawned
from tests.nccl_rules import ENV, served_devices

pytestmark = pytest.mark.slow


def _exchange(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from megatron_grpo.bench.sync.raw import RawTransfer
    from tests.nccl_rules import NcclRuleError

    peer = 1 - rank
    out: dict = {}
    bound = timedelta(seconds=3)

    def run(group, order: str) -> str:
        mine, theirs = torch.full((4,), float(rank)), torch.zeros(4)
        if order == "batch":
            ops = [
                dist.P2POp(dist.irecv, theirs, peer, group),
                dist.P2POp(dist.isend, mine, peer, group),
            ]
            works = dist.batch_isend_irecv(ops)
        elif order == "recv_first" or (order == "by_rank" and rank == 1):
            works = [
                dist.irecv(theirs, src=peer, group=group),
                dist.isend(mine, dst=peer, group=group),
            ]
        else:
            works = [
                dist.isend(mine, dst=peer, group=group),
                dist.irecv(theirs, src=peer, group=group),
            ]
        try:
            for w in works:
                w.wait(timeout=bound)
        except (NcclRuleError, RuntimeError) as exc:
            return f"stuck: {type(exc).__name__}"
        return "ok" if torch.equal(theirs, torch.full((4,), float(peer))) else "wrong bytes"

    # A group of its own per case: a deadlocked pair never unblocks its chain.
    for order in ("recv_first", "by_rank", "batch"):
        out[order] = run(dist.new_group([0, 1]), order)
    raw = RawTransfer({(0, 1): 64, (1, 0): 32}, rank, group=dist.new_group([0, 1]), timeout_s=20)
    st = raw.run()
    out["raw"] = (st.bytes_sent, st.bytes_received, float(raw.recv[(peer, rank)].sum()))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rules", ["off", "1"])
def test_emulation_deadlocks_unordered_p2p_and_raw_transfer_obeys_it(rules, monkeypatch):
    if rules == "off":
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, rules)
    res = run_spawned(_exchange, 2, timeout_s=90)
    for rank in (0, 1):
        r = res[rank]
        # Plain gloo hides the fault; NCCL (emulated) deadlocks on it.
        assert r["recv_first"] == ("ok" if rules == "off" else "stuck: NcclRuleError"), r
        assert r["by_rank"] == "ok" and r["batch"] == "ok", r
        sent, received, total = r["raw"]
        assert (sent, received) == ((64, 32) if rank == 0 else (32, 64))
        assert total == received // 4  # ones, float32


def test_served_devices_of_backend_strings():
    assert served_devices("nccl") == {"cuda"}
    assert served_devices("cpu:gloo,cuda:nccl") == {"cpu", "cuda"}
    assert "cpu" in served_devices("gloo")


class _CpuLogprobPolicy:
    """``Policy.compute_logprobs``'s contract: [B, L] fp32 log-probs on the CPU."""

    def compute_logprobs(self, batch, micro_batch_size, *, token_budget=None):
        n, length = batch.input_ids.shape
        return {"logp": batch.input_ids.float() * 0.5, "entropy": torch.zeros(n, length)}


def _call_sites(rank: int, world: int) -> dict:
    from megatron_grpo.algorithms.aggregation import compute_global_normalizers
    from megatron_grpo.config.schema import ParallelConfig
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.trainer.checkpointer import Preemption
    from megatron_grpo.trainer.logprobs import dp_logprobs
    from tests.helpers.batches import rows
    from tests.nccl_rules import NcclRuleError

    with distributed_context(ParallelConfig(tp=1, pp=1, backend="gloo")) as ctx:
        preemption = Preemption()  # this rank process's own signal handlers
        preemption.requested = rank == 1
        batch = rows(torch.arange(12).view(4, 3))
        sites = {
            "Preemption.agreed": lambda: preemption.agreed(ctx),
            "compute_global_normalizers": lambda: compute_global_normalizers(
                torch.ones(2, 3), group=ctx.dp_group
            ),
            "dp_logprobs": lambda: dp_logprobs(_CpuLogprobPolicy(), batch, ctx, 2, None),
        }
        out = {}
        for name, fn in sites.items():
            try:
                value = fn()
                out[name] = ("ok", value)
            except NcclRuleError as exc:
                out[name] = ("refused", str(exc))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rule", ["1", "nccl"])
def test_trainer_collectives_are_served_by_their_groups(rule, monkeypatch):
    # "1": the groups as init_distributed creates them on GPU; "nccl": the old rule.
    monkeypatch.setenv(ENV, rule)
    res = run_distributed(_call_sites, 2, timeout=90, result_types=(Normalizers,))
    for rank in (0, 1):
        r = res[rank]
        if rule == "nccl":
            for name, (status, msg) in r.items():
                assert status == "refused" and "cpu tensor" in msg, (name, msg)
            continue
        assert all(status == "ok" for status, _ in r.values()), r
        assert r["Preemption.agreed"][1] is True  # rank 1 asked to stop: both agree
        norm = r["compute_global_normalizers"][1]
        assert float(norm.num_tokens) == 12 and float(norm.num_seqs) == 4
        full = torch.arange(12).view(4, 3).float() * 0.5  # each DP rank's rows, gathered
        assert torch.equal(r["dp_logprobs"][1], full)
