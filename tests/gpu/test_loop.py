"""The loop on one device: ``GRPOTrainer.run()`` itself, without vLLM.

The real build (``trainer.build.build_trainer``), log-probs, train steps, syncs through the
real resharding bridge (pack, transport, unpack on the device) into a vLLM-layout sink,
checkpoints, a resume, and on a GPU the colocated memory dance (vLLM-style sleep, trainer
optimizer offload/reload) -- with ``tests/gpu/hf_engine.py`` sampling behind the rollout
interface where vLLM is not installed. The run is the tiny job in the device's own
configuration (``auto`` everywhere: bf16 + distributed optimizer on a GPU).

Checked: the syncs land on steps v, 2v, ...; at lag 0 the trainer's log-probs of the sampled
tokens equal the engine's (ratio 1: the bridge delivered the trainer's weights, every slice
of them); a run resumed from its step-2 checkpoint logs the same rows as the uninterrupted
one. Each run is its own process (``distributed.spawn``): the trainer builds and tears down
torch.distributed itself.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from megatron_grpo.distributed.spawn import spawn_ranks

STEPS, V = 4, 2
OVERRIDES = [
    f"steps={STEPS}", f"sync.interval={V}", "checkpoint.interval=2",
    "grpo.group_size=4", "grpo.batch.prompts_per_step=4", "grpo.batch.micro_batch_size=16",
    "rollout.max_new_tokens=4", "model.warm_start_steps=20", "logging.progress=false",
    "logging.tensorboard=false", "logging.plots=false",
]  # fmt: skip
SAME = ["reward_mean", "synced", "policy_version", "lag", "loss", "grad_norm", "ratio_mean"]


def _run(rank: int, world: int, run_dir: str, steps: int, resume: bool) -> dict:
    from megatron_grpo.config import load_config
    from megatron_grpo.trainer.build import build_trainer
    from megatron_grpo.trainer.run_dir import check_run_dir
    from tests.gpu.hf_engine import hf_rollout_factory

    cfg = load_config(None, [*OVERRIDES, f"run_dir={run_dir}", f"steps={steps}"])
    check_run_dir(cfg.run_dir, resume=resume, overwrite=False)
    t0 = time.perf_counter()
    trainer = build_trainer(cfg, resume=resume, rollout_factory=hf_rollout_factory)
    try:
        trainer.run()
        dtype = str(next(iter(dict(trainer.policy.named_shards()).values())).dtype)
        return {
            "seconds": time.perf_counter() - t0,
            "dtype": dtype,
            "distributed_optimizer": trainer.policy.distributed_optimizer,
            "memory_active": trainer.memory.active,
        }
    finally:
        trainer.close()


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_grpo_trainer_runs_syncs_checkpoints_and_resumes(tmp_path, device, figures):
    full, part = tmp_path / "full", tmp_path / "part"
    [info] = spawn_ranks(_run, 1, str(full), STEPS, False, timeout_s=600)
    spawn_ranks(_run, 1, str(part), 2, False, timeout_s=600)
    [resumed] = spawn_ranks(_run, 1, str(part), STEPS, True, timeout_s=600)
    a, b = _rows(full), _rows(part)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    assert [r["synced"] for r in a] == [k % V == 0 for k in range(1, STEPS + 1)]
    for r in a:
        if r["lag"] == 0:  # pi = alpha: the engine samples with the weights the trainer has
            tol = 2e-2 if info["dtype"] == "torch.bfloat16" else 1e-4
            assert abs(r["ratio_mean"] - 1.0) < tol, r
    for x, y in zip(a, b):
        for key in SAME:
            assert y[key] == pytest.approx(x[key], rel=1e-6, abs=1e-7), (x["step"], key)
    if device.type == "cuda":  # the GPU configuration and its memory dance ran
        assert info["dtype"] == "torch.bfloat16" and info["distributed_optimizer"]
        assert info["memory_active"]
    figures["loop_4_steps_s"] = info["seconds"]
    figures["loop_resume_2_steps_s"] = resumed["seconds"]
    figures["loop_dtype"] = info["dtype"]
