"""The training loop end to end: real Megatron-core training, real vLLM rollouts (CPU).

Each run is a separate ``megatron-grpo train`` process (vLLM and torch.distributed state
stay out of the test process) with a timeout; every process started here is waited for or
killed by the helper that started it.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from tests.helpers.commands import run as run_cmd
from tests.helpers.runs import FAST, assert_same_rows, rows, train

pytestmark = pytest.mark.slow


# One 6-step run at v=2 with validation every 2 steps and a checkpoint every 3 serves both
# the sync test and, as the uninterrupted run, the engine-failure-and-resume test.
SIX = ["--sync-interval", "2", "eval.interval=2", "eval.num_prompts=4", "checkpoint.interval=3",
       *FAST]  # fmt: skip


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory):
    run = tmp_path_factory.mktemp("six") / "run"
    rc, out = train(run, "--steps", "6", *SIX)
    assert rc == 0, out[-3000:]
    return run, out


@pytest.mark.timeout(600)
def test_syncs_exactly_every_v_and_vllm_serves_the_synced_weights(six_steps):
    run, out = six_steps
    r = rows(run)
    assert [x["step"] for x in r] == [1, 2, 3, 4, 5, 6]
    # Validation during training: every 2 steps, after the sync, on the weights vLLM serves.
    assert [x.get("eval_policy_version") for x in r] == [None, 2, None, 4, None, 6]
    assert all(0.0 <= r[i]["eval_pass@1"] <= 1.0 for i in (1, 3, 5))
    assert [x["synced"] for x in r] == [False, True, False, True, False, True]
    assert [x["policy_version"] for x in r] == [0, 0, 2, 2, 4, 4]
    assert [x["lag"] for x in r] == [0, 1, 0, 1, 0, 1]
    minimal = r[1]["sync_minimal_bytes"]
    assert minimal > 0
    assert [x["sync_bytes"] for x in r] == [0, minimal, 0, minimal, 0, minimal]
    # Every sync's phases (docs/metrics.md) split its seconds; vLLM's CPU repack ran.
    phases = ("handshake", "pack", "transfer", "unpack", "vllm_load", "vllm_post",
              "cache_reset", "other")  # fmt: skip
    for x in (r[1], r[3], r[5]):
        assert sum(x[f"sync_{p}_s"] for p in phases) == pytest.approx(x["sync_seconds"])
        assert x["sync_vllm_post_s"] > 0 and x["sync_unpack_s"] > 0
    # At lag 0 vLLM serves exactly the trainer's weights: the first SGD step's importance
    # ratio pi_theta / alpha is 1 up to fp32 noise (a stale or misplaced slice shows here).
    for x in r:
        if x["lag"] == 0:
            assert abs(x["ratio_mean"] - 1.0) < 1e-4, x
    assert "sync every v vs every step" in out
    assert (run / "checkpoints" / "step_000006" / "state.json").is_file()
    assert (run / "config.yaml").is_file() and (run / "summary.json").is_file()


# The engine raises on its ENGINE_DIES_AT-th generate, as a crashed EngineCore does: with
# SIX's validation after each sync (one generate after step 2), the 5th is step 4's rollout,
# one step past the checkpoint of step 3. (Guarded: megatron's checkpoint writer spawns a
# process that re-imports this script.)
ENGINE_DIES = """
import os, sys
from megatron_grpo.rollout import engine

if __name__ == "__main__":
    calls = {"n": 0}
    real = engine.RolloutEngine.generate

    def generate(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == int(os.environ["ENGINE_DIES_AT"]):
            raise RuntimeError("EngineCore died (simulated)")
        return real(self, *a, **k)

    engine.RolloutEngine.generate = generate
    from megatron_grpo.cli.main import main

    sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(900)
def test_engine_failure_is_clear_and_the_resumed_run_equals_the_uninterrupted_one(
    six_steps, tmp_path, monkeypatch
):
    """The run of six_steps, its engine dying in step 4: the run stops naming the step and
    its last checkpoint (step 3); ``--resume`` from there logs the uninterrupted run's rows.
    Step 3 is between syncs (v=2): vLLM serves step 2's weights, which the checkpoint keeps
    so the resumed run serves the same lagged policy. (One crashed run stands for the
    stopped one a resume test needs: one launch fewer than a stopped copy plus a crash.)"""
    full, part = six_steps[0], tmp_path / "part"
    script = tmp_path / "engine_dies.py"
    script.write_text(ENGINE_DIES)
    monkeypatch.setenv("ENGINE_DIES_AT", "5")
    args = ["train", "--run-dir", str(part), "--steps", "6", *SIX]
    rc, out = run_cmd([sys.executable, str(script), *args], 500)
    assert rc == 1, out[-3000:]
    assert "vLLM engine failed during the rollout of step 4" in out, out[-3000:]
    assert "step_000003" in out and "--resume" in out
    assert [x["step"] for x in rows(part)] == [1, 2, 3]
    rc, out = train(part, "--steps", "6", "--resume", *SIX)
    assert rc == 0, out[-3000:]
    assert "resumed from" in out and "vLLM serves step 2" in out
    a, b = rows(full), rows(part)
    assert [x["step"] for x in b] == [1, 2, 3, 4, 5, 6]
    assert_same_rows(a, b)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("v", [1, 2])
def test_grpo_learns_the_synthetic_task(tmp_path, v):
    """The embedded default task, on-policy (v=1) and off-policy (v=2): reward rises.

    With the defaults (15 warm-start steps, lr 1e-3) the reward starts near 0.35; over 40
    steps GRPO lifts it well past the first steps' mean (the demo's 60 steps reach ~0.73).
    """
    run = tmp_path / f"v{v}"
    rc, out = train(run, "--steps", "40", "--sync-interval", str(v), "logging.progress=false",
                    "logging.tensorboard=false", "logging.plots=false", "checkpoint.save_at_end=false")  # fmt: skip
    assert rc == 0, out[-3000:]
    r = rows(run)
    first = sum(x["reward_mean"] for x in r[:10]) / 10
    last = sum(x["reward_mean"] for x in r[-10:]) / 10
    assert last > first + 0.15, (v, first, last, [round(x["reward_mean"], 2) for x in r])
    assert sum(x["synced"] for x in r) == 40 // v


@pytest.mark.timeout(600)
def test_a_users_loss_class_trains_without_touching_the_trainer(tmp_path):
    """docs/algorithms.md's worked example (docs/examples/cispo_loss.py) named by
    grpo.loss.policy_loss: a real run trains with it, and pi_k's pass runs because it declares
    pi_k (ratio_mode=exact), so the drift is measured."""
    example = Path(__file__).resolve().parents[2] / "docs" / "examples" / "cispo_loss.py"
    run = tmp_path / "run"
    rc, out = train(run, "--steps", "2", f"grpo.loss.policy_loss={example}:Cispo",
                    "grpo.off_policy.ratio_mode=exact", "checkpoint.save_at_end=false", *FAST)  # fmt: skip
    assert rc == 0, out[-3000:]
    r = rows(run)
    assert [x["step"] for x in r] == [1, 2]
    assert all(x["drift"] is not None and math.isfinite(x["loss"]) for x in r), r
