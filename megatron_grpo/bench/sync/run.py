"""``megatron-grpo bench sync``: the resharding bridge vs the anchors' gather-and-broadcast
vs a raw flat transfer of the same bytes, on the same processes and process group.

Placement: colocated, as in the trainer (``bridge/weight_sync.py``): ``world =
lcm(tp*pp, rollout_tp)`` spawned ranks, each a Megatron trainer rank (dp = world/(tp*pp))
hosting one vLLM TP rank (``external_launcher``). With ``sink="null"`` no vLLM engine is
started: the bridge builds the destination shards and drops them, and the baseline drops
the full tensors -- the transfer alone, for shapes whose vLLM engine would not fit.

Every rank loads the HF checkpoint into Megatron, then scales all weights by 0.9 before
each measured method, so that the engine (started from the unscaled checkpoint) must
really receive new weights for the checks to pass:
- destination shards equal the same shards assembled from the HF checkpoint (scaled) by
  the layouts' vLLM slicing -- independent of the plan's routing;
- vLLM's read-back checksums equal those of the shards delivered (``bridge.verify``);
- vLLM's prompt logprobs match the Megatron policy's on fixed sequences.

The parts: ``sync.args`` (the arguments and the model), ``sync.rank`` (one spawned rank's
measurements and checks) and ``sync.summary`` (the result over the ranks, the table).
"""

from __future__ import annotations

import time
from dataclasses import asdict

from megatron_grpo.bench.sync.args import BenchSyncArgs, resolve_model
from megatron_grpo.bench.sync.rank import bench_rank
from megatron_grpo.bench.sync.summary import summarize
from megatron_grpo.config import ConfigError
from megatron_grpo.distributed import spawn
from megatron_grpo.models.spec import check_heads, load_spec


def run_bench_sync(a: BenchSyncArgs) -> dict:
    hf_dir = resolve_model(a)
    try:  # before any rank starts, not vLLM's pydantic error from a spawned rank
        check_heads(load_spec(hf_dir), a.train_tp, a.rollout_tp)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    t0 = time.perf_counter()
    # through the module: tests/bad_inputs.py stubs spawn_ranks out there
    per_rank = spawn.spawn_ranks(
        bench_rank, a.world, a, str(hf_dir), timeout_s=3600.0, threads=a.threads
    )
    res = summarize(a, per_rank, hf_dir)
    res["wall_s"] = time.perf_counter() - t0
    res["args"] = asdict(a)
    return res
