"""Faults under a real torchrun on CPU (2 ranks): kill -9 of a rank right after a checkpoint,
a damaged checkpoint on resume, and no process of the run left behind.

Every process a run starts carries ``MGRPO_FAULT_MARKER=<unique>`` in its environment (they
inherit it); after each run the test looks for live processes with that marker, which would
be orphans (their parent is gone), and kills exactly those before failing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch

from tests.helpers.runs import assert_same_rows, final_weights, rows

pytestmark = pytest.mark.slow

TWO_RANKS = [
    "grpo.group_size=4",
    "grpo.batch.prompts_per_step=4",
    "grpo.batch.micro_batch_size=16",
    "rollout.max_new_tokens=4",
    "rollout.cpu_kv_cache_gb=0.25",
    "model.warm_start_steps=0",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.plots=false",
    "checkpoint.interval=1",
    "checkpoint.keep_last=3",
    "sync.interval=2",
]

# Rank 0 dies (SIGKILL, no cleanup) right after the checkpoint of step KILL_AFTER is
# committed: the moment at which the old loop had saved but not yet logged the step.
# (Guarded: the checkpoint Manager is a spawned process that re-imports this script.)
KILL_AFTER_SAVE = """
import os, signal, sys

if __name__ == "__main__":
    from megatron_grpo.trainer.checkpointer import Checkpointer

    real = Checkpointer.save

    def save(self, state):
        real(self, state)
        if state.step == int(os.environ["KILL_AFTER"]) and self.ctx.rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    Checkpointer.save = save
    from megatron_grpo.cli.main import main

    sys.exit(main(sys.argv[1:]))
"""


def _marked(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get("MGRPO_FAULT_MARKER") == marker:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def assert_no_leftovers(marker: str, grace_s: float = 20.0, known: str = "") -> None:
    """No process of the run is alive ``grace_s`` after it ended (kills any it finds); one
    whose command line holds ``known`` (when given) is killed without failing the test."""
    deadline = time.monotonic() + grace_s
    while (left := _marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    described = []
    for p in left:
        try:
            if known and known in " ".join(p.cmdline()):
                p.kill()
                continue
            described.append(f"{p.pid} (parent {p.ppid()}): {' '.join(p.cmdline())[:160]}")
            p.kill()
        except psutil.NoSuchProcess:
            pass
    assert not described, "processes outlived the run:\n" + "\n".join(described)


def torchrun(script: Path, args: list[str], marker: str, timeout: int, **env) -> tuple[int, str]:
    """``torchrun --nproc-per-node 2 script args`` (env MAX_RESTARTS: its --max-restarts)."""
    restarts = env.pop("MAX_RESTARTS", "0")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "MGRPO_FAULT_MARKER": marker, **env}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", f"--max-restarts={restarts}", str(script), *args]  # fmt: skip
    # Output to a file, not a pipe: an orphan holding the pipe open would block the reader.
    log = script.with_name(f"torchrun_{uuid.uuid4().hex[:6]}.log")
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
        try:
            proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    return proc.returncode, log.read_text(errors="replace")


def _train_log_tail(run_dir: Path, chars: int = 3000) -> str:
    """The end of the run's library log (the console shows only the project's lines)."""
    log = run_dir / "train.log"
    return "train.log: " + (log.read_text(errors="replace")[-chars:] if log.exists() else "none")


def steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x)["step"] for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(600)
def test_kill_after_checkpoint_loses_no_row_leaves_no_orphan_and_resume_skips_damage(tmp_path):
    run, script = tmp_path / "run", tmp_path / "kill_after_save.py"
    script.write_text(KILL_AFTER_SAVE)
    marker = uuid.uuid4().hex
    args = ["train", "--run-dir", str(run), "--steps", "3", *TWO_RANKS]
    rc, out = torchrun(script, args, marker, 280, KILL_AFTER="2")
    try:
        assert rc != 0, out[-3000:]
        latest = run / "checkpoints" / "latest"
        assert latest.exists(), f"no checkpoint: {out[-2000:]}\n{_train_log_tail(run)}"
        assert latest.read_text().strip() == "step_000002", out[-3000:]
        # The checkpoint of step 2 exists, so step 2's row must too (logged before saving).
        assert steps(run) == [1, 2], out[-3000:]
    finally:
        assert_no_leftovers(marker)

    # Damage the newest checkpoint: resume names the file and falls back to step 1.
    shard = sorted((run / "checkpoints" / "step_000002" / "policy").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    rc, out = torchrun(script, [*args, "--resume"], marker, 280, KILL_AFTER="0")
    try:
        assert rc == 0, out[-3000:]
        assert f"checkpoint step_000002 is damaged: {shard} has 100 bytes" in out, out[-3000:]
        assert "falling back to the newest intact checkpoint, step_000001" in out
        assert "Traceback" not in out
        assert steps(run) == [1, 2, 3]
    finally:
        assert_no_leftovers(marker)


# Two faults, one per attempt (TORCHELASTIC_RESTART_COUNT), each off unless its variables
# are set. HANG_AT: rank HANG_RANK hangs (SIGSTOP: alive, every thread of it frozen, as a rank
# stuck in a kernel or a deadlock) after step HANG_AT on attempt HANG_ATTEMPT, once the step's
# collective is through (rank 0 has logged its row: it logs before after_step), its pid and
# the time written to HANG_FILE first; the other rank goes on into the next step and waits
# there for it. COMMIT_KILL_AT: rank 0 dies (SIGKILL) on attempt COMMIT_KILL_ATTEMPT in the
# middle of the save of step COMMIT_KILL_AT, every rank's files written but the checkpoint
# not committed.
KILLS = """
import os, signal, sys, time

if __name__ == "__main__":
    from megatron_grpo.checkpoint import core
    from megatron_grpo.trainer.checkpointer import Checkpointer

    env, attempt = os.environ, os.environ["TORCHELASTIC_RESTART_COUNT"]
    commit, after_step = core._commit, Checkpointer.after_step

    def hanging_after_step(self, step, state):
        out = after_step(self, step, state)
        if (step == int(env["HANG_AT"]) and self.ctx.rank == int(env["HANG_RANK"])
                and attempt == env["HANG_ATTEMPT"]):
            with open(env["HANG_FILE"], "w") as fh:
                fh.write(f"{os.getpid()} {time.time()}")
            os.kill(os.getpid(), signal.SIGSTOP)
        return out

    def dying_commit(tmp, final, root):
        if final.name == f"step_{int(env['COMMIT_KILL_AT']):06d}":
            os.kill(os.getpid(), signal.SIGKILL)
        commit(tmp, final, root)

    if "HANG_AT" in env:
        Checkpointer.after_step = hanging_after_step
        # the time the watchdog ends a rank, for the hang's detection time
        from megatron_grpo.trainer import watchdog

        exit_timeout = watchdog.exit_timeout

        def timed_exit(line):
            with open(env["HANG_FILE"] + f".caught{os.getpid()}", "w") as fh:
                fh.write(str(time.time()))
            exit_timeout(line)

        watchdog.exit_timeout = timed_exit
    if "COMMIT_KILL_AT" in env and attempt == env["COMMIT_KILL_ATTEMPT"]:
        core._commit = dying_commit
    from megatron_grpo.cli.main import main

    sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(900)
def test_killed_ranks_restart_in_place_and_the_job_ends_as_an_uninterrupted_run(tmp_path):
    """torchrun --max-restarts 2 ... --resume auto with window-ahead rollouts
    (rollout.ahead=1), two faults in a row: rank 1 hung (SIGSTOP) after step 3 (attempt 0):
    rank 0 waits for it in step 4's training all-reduce until the watchdog ends it after
    parallel.timeout_s (set small here), and torchrun stops the hung rank and restarts both;
    then kill -9 of rank 0 in the middle of the save of step 4, its files written but not
    committed (attempt 1). Each restart resumes
    from step 2's checkpoint (the half-written step 4 is not taken), and the job finishes by
    itself with every step's row once, the rewards, losses and final weights of the
    uninterrupted run, and no process of the hung attempt left. (One job for both faults: a
    torchrun attempt each, not a whole job each. A rank killed after a step, which this test
    did before the hang replaced it, costs less than either: its peers fail at once.)"""
    script = tmp_path / "kills.py"
    script.write_text(KILLS)
    marker = uuid.uuid4().hex
    # rollout.ahead=1: step k+1's rollout is in flight while step k trains, so a kill after
    # step 3 drops a generated window the restart must generate again, the same.
    # parallel.timeout_s=15: the watchdog's bound on each phase's wait, which a hung peer
    # costs (the default, 600 s, is the collective timeout of a real cluster).
    base = ["--steps", "4", *TWO_RANKS, "checkpoint.interval=2", "rollout.ahead=1",
            "parallel.timeout_s=15", "--resume", "auto"]  # fmt: skip
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    rc, out = torchrun(script, ["train", "--run-dir", str(whole), *base], marker, 400)
    try:
        assert rc == 0, out[-3000:]
    finally:
        assert_no_leftovers(marker)
    hang = tmp_path / "hang"
    rc, out = torchrun(script, ["train", "--run-dir", str(cut), *base], marker, 700,
                       HANG_AT="3", HANG_RANK="1", HANG_ATTEMPT="0", COMMIT_KILL_AT="4",
                       COMMIT_KILL_ATTEMPT="1", HANG_FILE=str(hang), MAX_RESTARTS="2")  # fmt: skip
    try:
        assert rc == 0, out[-3000:] + _train_log_tail(cut)
        # Each attempt's line: attempt 1 after the hang after step 3, attempt 2 after the
        # kill in step 4's save; both continue from step 2.
        # the hang: rank 0's watchdog names the wait and its bound, and the restart its cause
        caught = "error: rank 0: the training of step 4 did not finish within 15s "
        assert caught in out, out[-3000:]
        assert ("restart 1 of 2: the previous attempt failed at step 4 (TimeoutError: the "
                "training of step 4 did not finish within 15s (parallel.timeout_s))") in out  # fmt: skip
        # a failure in the save of step 4 is a failure of step 4 (it was not finished)
        assert "restart 2 of 2: the previous attempt failed at step 4" in out, out[-3000:]
        assert out.count("continuing from step 2") == 2, out[-3000:]
        assert "resumed from" in out and "(step 2," in out, out[-3000:]
        # torchrun stopped the hung rank (SIGTERM, then SIGKILL after its 30 s grace)
        hung_pid, hung_at = hang.read_text().split()
        assert not psutil.pid_exists(int(hung_pid)), out[-3000:]
        [caught_at] = tmp_path.glob("hang.caught*")
        print(f"hang caught {float(caught_at.read_text()) - float(hung_at):.1f}s after SIGSTOP")
        assert steps(cut) == [1, 2, 3, 4]  # no row of a failed attempt repeated
        assert (cut / "checkpoints" / "latest").read_text().strip() == "step_000004"
        assert (cut / "checkpoints" / "step_000004" / "state.json").is_file()
        assert_same_rows(rows(whole), rows(cut))
        a, b = final_weights(whole, 4), final_weights(cut, 4)
        assert a.keys() == b.keys() and a
        for k in a:
            assert torch.equal(a[k], b[k]), k
    finally:
        assert_no_leftovers(marker)


# FAULT_AT: rank 0's step FAULT_AT raises on every attempt (a restart loop).
FAULT_SCRIPT = """
import os, sys

if __name__ == "__main__":
    from megatron_grpo.trainer.checkpointer import Checkpointer

    at, after_step = int(os.environ["FAULT_AT"]), Checkpointer.after_step

    def failing_after_step(self, step, state):
        if step == at and self.ctx.rank == 0:
            raise RuntimeError(f"simulated fault in step {step}")
        return after_step(self, step, state)

    Checkpointer.after_step = failing_after_step
    from megatron_grpo.cli.main import main

    sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(600)
def test_a_restart_loop_stops_after_max_restarts_with_one_line(tmp_path):
    script, run = tmp_path / "fault.py", tmp_path / "run"
    script.write_text(FAULT_SCRIPT)
    marker = uuid.uuid4().hex
    args = ["train", "--run-dir", str(run), "--steps", "4", *TWO_RANKS,
            "checkpoint.interval=2", "--resume", "auto"]  # fmt: skip
    rc, out = torchrun(script, args, marker, 500, FAULT_AT="3", MAX_RESTARTS="1")
    try:
        assert rc != 0, out[-3000:]
        lines = [x for x in out.splitlines() if "restart loop" in x]
        assert len(lines) == 1, out[-3000:]
        assert lines[0].endswith(
            "error: restart loop: step 3 failed on each of the 2 attempts (MAX_RESTARTS=1), "
            "last with RuntimeError: simulated fault in step 3: stopping; fix the cause, then "
            "launch again (--resume auto continues from the latest checkpoint)."
        ), lines
        assert "restart 1 of 1: the previous attempt failed at step 3 (RuntimeError: " in out
        rows_logged = steps(run)
        assert rows_logged[:2] == [1, 2] and len(set(rows_logged)) == len(rows_logged)
    finally:
        assert_no_leftovers(marker)


# The engine's driver (rollout rank 1 of the disaggregated placement) dies (SIGKILL) at its
# KILL_AT-th generate on the first attempt only. With validation after each sync (eval.interval
# = v = 2: a generate after step 2), the 4th is step 3's rollout.
ENGINE_KILLED_ONCE = """
import os, signal, sys

if __name__ == "__main__":
    from megatron_grpo.rollout import engine

    calls = {"n": 0}
    real = engine.RolloutEngine.generate

    def generate(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == int(os.environ["KILL_AT"]) and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *a, **k)

    engine.RolloutEngine.generate = generate
    from megatron_grpo.cli.main import main

    sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(900)
def test_a_killed_engine_rank_restarts_the_disaggregated_job_in_place(tmp_path):
    """``rollout.placement=disaggregated`` end to end (trainer rank 0; rollout rank 1 driving
    a standalone vLLM engine of tp 1 whose worker is its own process; the weights cross
    processes through the bridge's plan and transport on both sides), and kill -9 of the
    engine's rank in step 3 under torchrun --max-restarts 1: the job restarts both, resumes
    from step 2 and ends with every step's row once, syncing every v = 2 steps, validating
    through the engines after each sync, and serving the trainer's weights (restarted too);
    its rows and final weights are the uninterrupted run's, and no process is left."""
    script, run = tmp_path / "engine_killed.py", tmp_path / "run"
    script.write_text(ENGINE_KILLED_ONCE)
    marker = uuid.uuid4().hex
    args = ["train", "--run-dir", str(run), "--steps", "4", *TWO_RANKS,
            "rollout.placement=disaggregated", "rollout.num_engines=1", "eval.interval=2",
            "eval.num_prompts=4", "checkpoint.interval=2",
            # FAST's warm start: without it every reward is 0 and no token is scored, so the
            # lag-0 ratio below would be 0, not 1.
            "model.warm_start_steps=20", "--resume", "auto"]  # fmt: skip
    whole = tmp_path / "whole"
    rc, out = torchrun(script, ["train", "--run-dir", str(whole), *args[3:]], marker, 600,
                       KILL_AT="0")  # fmt: skip
    try:
        assert rc == 0, out[-3000:] + _train_log_tail(whole)
    finally:
        assert_no_leftovers(marker)
    rc, out = torchrun(script, args, marker, 800, KILL_AT="4", MAX_RESTARTS="1")
    try:
        assert rc == 0, out[-3000:] + _train_log_tail(run)
        assert "restart 1 of 1: the previous attempt failed" in out, out[-3000:]
        assert "resumed from" in out and "(step 2," in out, out[-3000:]
        assert steps(run) == [1, 2, 3, 4]
        r = rows(run)
        assert [x["synced"] for x in r] == [False, True, False, True]
        assert [x["policy_version"] for x in r] == [0, 0, 2, 2]
        assert [x["lag"] for x in r] == [0, 1, 0, 1]
        # Validation through the engines (RolloutClient.generate) after each sync.
        assert [x.get("eval_policy_version") for x in r] == [None, 2, None, 4]
        assert all(0.0 <= r[i]["eval_pass@1"] <= 1.0 for i in (1, 3))
        minimal = r[1]["sync_minimal_bytes"]
        assert minimal > 0
        assert [x["sync_bytes"] for x in r] == [0, minimal, 0, minimal]
        # All of it crossed processes: trainer rank 0 -> the engine's worker (transfer rank 1).
        assert [x.get("sync_wire_bytes") for x in r if x["synced"]] == [minimal, minimal]
        # At lag 0 the engine serves exactly the trainer's weights: ratio pi_theta/alpha == 1
        # (step 3: the restarted engine, loaded by the resumed trainer's initial sync).
        for x in r:
            if x["lag"] == 0:
                assert abs(x["ratio_mean"] - 1.0) < 1e-4, x
        assert (run / "checkpoints" / "step_000004" / "state.json").is_file()
        # The uninterrupted run's rows (rewards, losses, syncs, ratios) and final weights.
        assert_same_rows(rows(whole), r)
        a, b = final_weights(whole, 4), final_weights(run, 4)
        assert a.keys() == b.keys() and a
        for k in a:
            assert torch.equal(a[k], b[k]), k
    finally:
        # Nothing of the killed driver outlives the job: its engine core, armed to die with
        # it (rollout/vllm_setup.py), takes the resource tracker it held along.
        assert_no_leftovers(marker)
