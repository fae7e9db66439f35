"""How close the colocated ``rollout.ahead`` samples are to the serial schedule's.

The colocated ahead schedule puts a window's steps into one vLLM call, each request seeded
as its own step's call would seed it (rollout/ahead.py). vLLM's per-request seed fixes the
random stream, but the logits of a request may still depend on what else is in the batch
(kernel batch sizes, padding): vLLM on CPU is not batch-invariant. This measures the
fraction of responses that come out token-identical, serial (one call per step) vs one call
for the window, on the tiny model.

    PYTHONPATH=$PWD python -m megatron_grpo.bench.throughput.ahead_identity --steps 4 --prompts 8 --group 8
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

from megatron_grpo.algorithms.seeds import sampling_seed
from megatron_grpo.distributed.spawn import free_port
from megatron_grpo.models.tiny import build_hf_model
from megatron_grpo.rollout.engine import RolloutEngine


def measure(steps: int, prompts: int, group: int, max_new_tokens: int, seed: int = 0) -> dict:
    """Serial vs merged generation of ``steps`` steps of ``prompts`` x ``group`` samples."""
    import random

    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    rng = random.Random(seed)
    batches = [
        [[rng.randrange(3, 60) for _ in range(rng.randrange(4, 12))] for _ in range(prompts)]
        for _ in range(steps)
    ]
    sampling: dict[str, Any] = dict(n=group, temperature=1.0, max_new_tokens=max_new_tokens)
    with tempfile.TemporaryDirectory() as d:
        model = build_hf_model(d, seed=1)
        eng = RolloutEngine(model, tp=1, max_model_len=128, cpu_kv_cache_gb=0.25)
        try:
            serial = []
            for s, ids in enumerate(batches, start=1):
                serial += eng.generate(ids, seed=sampling_seed(seed, s), **sampling)
            seeds = [sampling_seed(seed, s) + i * group for s in range(1, steps + 1)
                     for i in range(prompts)]  # fmt: skip
            merged = eng.generate([p for b in batches for p in b], seeds=seeds, **sampling)
        finally:
            eng.shutdown()
            dist.destroy_process_group()
    same = sum(a.response_ids == b.response_ids for a, b in zip(serial, merged, strict=True))
    return {
        "steps": steps, "prompts": prompts, "group": group, "max_new_tokens": max_new_tokens,
        "responses": len(serial), "identical": same, "identical_fraction": same / len(serial),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    a = ap.parse_args()
    print(json.dumps(measure(a.steps, a.prompts, a.group, a.max_new_tokens)))


if __name__ == "__main__":
    main()
