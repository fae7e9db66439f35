"""Launchers and sbatch templates: shellcheck, and end-to-end runs under a fake Slurm.

The fake Slurm (tests/fake_slurm: sbatch runs the batch script here, srun runs its command
once per "node" on this machine, scontrol prints localhost and records requeues) drives the
real templates: they really start torchrun and the trainer on CPU with 2 processes. The
preemption test sends USR1 to the batch script (the process this test started), expects a
checkpoint, a requeue record and exit 0, starts the "requeued" job, and checks that it
resumes at checkpoint step + 1 and that metrics.jsonl holds every step exactly once.
Every process these tests start is in a process tree rooted at the batch script; teardown
signals exactly those processes (by pid), never by name.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.bad_inputs import RANK0_LATE, delay_env
from tests.helpers.runs import assert_same_rows, final_weights
from tests.helpers.runs import rows as metrics_rows

REPO = Path(__file__).resolve().parents[2]
FAKE_SLURM = REPO / "tests" / "fake_slurm"
VENV_BIN = Path(sys.executable).parent
SCRIPTS = sorted([*REPO.glob("launchers/*.sh"), *REPO.glob("slurm/*"), *FAKE_SLURM.glob("*")])

# A tiny, fast run: the embedded default config (tiny preset model built in the run dir).
TINY = [
    "grpo.group_size=2",
    "grpo.batch.prompts_per_step=2",
    "grpo.batch.micro_batch_size=4",
    "rollout.max_new_tokens=4",
    "model.warm_start_steps=0",
    "logging.progress=false",
    "logging.plots=false",
    "logging.tensorboard=false",
    "sync.interval=2",
]


@pytest.mark.parametrize("script", SCRIPTS, ids=[str(s.relative_to(REPO)) for s in SCRIPTS])
def test_shellcheck(script: Path) -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    out = subprocess.run(
        ["shellcheck", "-x", "-S", "style", str(script.relative_to(REPO))],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


class Job:
    """One fake-Slurm batch job started in its own session; ``stop()`` ends its tree."""

    def __init__(self, sbatch_args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._fh = open(log, "ab")
        self.proc = subprocess.Popen(
            [str(FAKE_SLURM / "sbatch"), *sbatch_args],
            cwd=REPO, env=env, stdout=self._fh, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self._tree: dict[int, psutil.Process] = {}

    def _remember_tree(self) -> None:
        try:
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                self._tree.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            pass

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            self._remember_tree()
            if time.monotonic() > deadline:
                raise TimeoutError(f"job still running after {timeout:.0f}s; log:\n{self.text()}")
            time.sleep(0.5)
        return self.proc.returncode

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            self._remember_tree()
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"job exited ({self.proc.returncode}) before {what}:\n{self.text()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} after {timeout:.0f}s; log:\n{self.text()}")
            time.sleep(0.5)

    def text(self) -> str:
        self._fh.flush()
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        """End every process of this job's tree that is still alive (by pid)."""
        self._remember_tree()
        alive = [p for p in self._tree.values() if p.is_running()]
        for p in alive:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(alive, timeout=15)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        if self.proc.poll() is None:
            self.proc.wait(timeout=5)
        self._fh.close()


@pytest.fixture
def slurm_env(tmp_path: Path):
    """Environment of a fake Slurm job, and a list the test appends its jobs to."""
    state = tmp_path / "slurm"
    state.mkdir()
    job_id = 10000 + (os.getpid() * 7 + int(time.time())) % 30000
    env = {
        **os.environ,
        "PATH": f"{FAKE_SLURM}:{VENV_BIN}:{os.environ.get('PATH', '')}",
        "FAKE_SLURM_DIR": str(state),
        "SLURM_JOB_ID": str(job_id),
        "RUN_DIR": str(tmp_path / "run"),
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "GRACE_S": "60",
        "LOG_DIR": str(tmp_path / "logs"),
    }
    jobs: list[Job] = []
    yield env, jobs
    for job in jobs:
        job.stop()


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def _requeued(env: dict[str, str]) -> list[str]:
    path = Path(env["FAKE_SLURM_DIR"]) / "requeued"
    return path.read_text().split() if path.is_file() else []


LAYOUTS = {
    # template: (nodes, GPUs per node)
    "slurm/single_node.sbatch": (1, 2),
    "slurm/multi_node.sbatch": (2, 1),
}
# Each layout's finished run (metrics rows, final weights), compared with the other's: the
# same world of 2 ranks and config, one run pre-empted, the other losing a rank first too.
_FINISHED: dict[str, tuple[list[dict], dict]] = {}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("template", list(LAYOUTS))
def test_preempt_requeue_resume(template: str, slurm_env, tmp_path: Path) -> None:
    """A pre-emption warning: the job saves, exits 0 and is requeued; the requeued job
    resumes. On two nodes the first job loses a rank first: rank 1 (node 1) is killed after
    step 3 (tests/rank_fault_site), and the template's in-job restarts (MAX_RESTARTS=2,
    --resume auto) restart both nodes' ranks, which continue from step 2's checkpoint (only
    node 1's torchrun counts the restart: slurm/common.sh)."""
    env, jobs = slurm_env
    nodes, gpus = LAYOUTS[template]
    env["GPUS_PER_NODE"] = str(gpus)
    run_dir = Path(env["RUN_DIR"])
    steps = 10
    args = [f"--nodes={nodes}", template, f"steps={steps}", "checkpoint.interval=2", *TINY]
    killed = nodes > 1
    if killed:
        path = [str(REPO / "tests" / "rank_fault_site"), str(REPO), env.get("PYTHONPATH")]
        env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, path)),
               "MEGATRON_GRPO_TEST_KILL": "1:3"}  # fmt: skip

    first = Job(args, env, tmp_path / "job.log")
    jobs.append(first)
    # After a save: torchrun signals its workers' whole process group, which used to kill
    # the Manager process dist-checkpointing starts at the first save, so the pre-emption
    # save died with BrokenPipeError (platform/lifetime.py keeps it out of that group).
    latest = run_dir / "checkpoints" / "latest"
    # Killed: step 4 logged means the restarted attempt is training.
    first.wait_for(lambda: latest.is_file() and len(_steps(run_dir)) >= 3 + killed, 400,
                   "the first checkpoint and step 3")  # so a save follows the signal  # fmt: skip
    os.kill(first.proc.pid, signal.SIGUSR1)  # Slurm's warning, to the batch script only
    assert first.wait(240) == 0, first.text()
    log1 = first.text()
    m = re.search(r"preemption signal: checkpoint at step (\d+) saved, exiting", log1)
    assert m, log1
    saved = int(m.group(1))
    assert 2 < saved < steps, log1
    assert "BrokenPipeError" not in log1, log1
    assert _requeued(env) == [env["SLURM_JOB_ID"]], log1
    assert (run_dir / "checkpoints" / "latest").read_text().strip().endswith(f"{saved:06d}")
    assert _steps(run_dir) == list(range(1, saved + 1))  # killed: step 3 once, run twice
    if killed:
        assert re.search(r"resumed from \S+step_000002 \(step 2,", log1), log1
        assert "restart 1 of 2: the previous attempt" in log1, log1

    env2 = {**env, "SLURM_RESTART_COUNT": "1"}  # the requeued job: same id, same run dir
    second = Job(args, env2, tmp_path / "job2.log")
    jobs.append(second)
    assert second.wait(240) == 0, second.text()
    log2 = second.text()
    assert "--resume" in log2 and f"(step {saved}," in log2, log2
    rows = _steps(run_dir)
    assert rows == list(range(1, steps + 1)), rows  # each step exactly once
    assert rows[saved] == saved + 1  # the resumed run's first step
    # The same rows and weights as the other layout's run, when it ran in this session.
    finished = (metrics_rows(run_dir), final_weights(run_dir, steps))
    for other, (other_rows, other_weights) in _FINISHED.items():
        assert_same_rows(other_rows, finished[0])
        assert other_weights.keys() == finished[1].keys() and other_weights, other
        for k in other_weights:
            assert torch.equal(other_weights[k], finished[1][k]), (other, k)
    _FINISHED[template] = finished
    assert _requeued(env) == [env["SLURM_JOB_ID"]]  # no second requeue
    # Per-rank logs of every node next to the job log (torchrun --log-dir/--tee).
    assert len(list((tmp_path / "logs").glob("**/stdout.log"))) >= 2 * nodes * gpus
    srun = (Path(env["FAKE_SLURM_DIR"]) / "srun.log").read_text().splitlines()
    assert len(srun) == 2 and all(
        f"--nnodes={nodes} --nproc-per-node={gpus}" in line
        and f"--rdzv-endpoint=localhost:{20000 + int(env['SLURM_JOB_ID']) % 40000}" in line
        for line in srun
    ), srun


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_disaggregated_template_splits_nodes(slurm_env, tmp_path: Path) -> None:
    """Node split: the last node serves vLLM, the first trains, the trainer takes the
    placement from the script's overrides and runs to the end; nothing is requeued."""
    env, jobs = slurm_env
    env["GPUS_PER_NODE"] = "1"
    job = Job(
        ["--nodes=2", "slurm/disaggregated.sbatch", "steps=3", *TINY], env, tmp_path / "job.log"
    )
    rc = job.wait(380)
    log = job.text()
    assert "train ranks 0-0" in log and "rollout ranks 1-1" in log, log
    assert "placement    disaggregated: train ranks 0, rollout ranks 1" in log, log  # preflight
    srun = (Path(env["FAKE_SLURM_DIR"]) / "srun.log").read_text()
    assert "rollout.placement=disaggregated rollout.num_engines=1 rollout.tp=1" in srun
    assert rc == 0, log[-4000:]
    assert _steps(Path(env["RUN_DIR"])) == [1, 2, 3]
    assert _requeued(env) == []


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("template", list(LAYOUTS))
def test_refused_job_prints_one_line_whichever_rank_refuses_first(
    template: str, slurm_env, tmp_path: Path
) -> None:
    """A bad input that reaches the ranks of a job, 5 times per template, each rank's checks
    held back at random (tests/rank_delay_site): the job log holds the one line once and no
    traceback (the templates run torchrun through distributed/quiet_torchrun.py, which drops
    torchrun's ChildFailedError report when every failed rank exited 2), and the job exits 2
    (srun's status: the first node's torchrun's, which is 2 only when its every rank exited
    2, the code of a refusal). The first job is the one a user gets: RUN_DIR is a file, which the
    preflight plan (it reads no paths) lets through, with rank 0 held back, under the
    template's default in-job restarts (MAX_RESTARTS=2: every attempt refuses, the later
    ones without the line, cli/errors.py); the others skip the plan (PREFLIGHT=0) and the
    restarts (MAX_RESTARTS=0) so a config value is refused by the ranks, cheaply."""
    env, jobs = slurm_env
    nodes, gpus = LAYOUTS[template]
    (tmp_path / "afile").write_text("x")
    env["GPUS_PER_NODE"] = str(gpus)
    rng = random.Random(34)
    runs = [(RANK0_LATE, str(tmp_path / "afile"), "1", [], "error: run_dir=", None)]
    for _ in range(4):
        delays = {r: round(rng.uniform(0, 1), 2) for r in range(nodes * gpus)}
        runs.append(
            (delays, env["RUN_DIR"], "0", ["grpo.group_size=-4"], "error: grpo.group_", "0")
        )
    for i, (delays, run_dir, preflight, args, line, restarts) in enumerate(runs):
        job_env = {**delay_env(env, delays), "RUN_DIR": run_dir, "PREFLIGHT": preflight}
        if restarts is not None:
            job_env["MAX_RESTARTS"] = restarts
        job = Job([f"--nodes={nodes}", template, *args], job_env, tmp_path / f"job{i}.log")
        jobs.append(job)
        rc = job.wait(300)
        log = job.text()
        print(f"--- job {i} log (shown when the test fails) ---\n{log[-8000:]}")
        case = (delays, preflight, rc, log[-3000:])
        assert sum(line in x for x in log.splitlines()) == 1, case
        assert rc == 2 and "srun step exited with status 2" in log, case
        for noise in ("Traceback", "ChildFailedError", "exitcode"):
            assert noise not in log, (noise, *case)
    assert not Path(env["RUN_DIR"]).exists()


# Task 0 fails; task 1 ignores TERM, as a torchrun that TERM reaches mid-shutdown may.
_STUBBORN_TASK = """
if [[ $SLURM_NODEID == 0 ]]; then sleep 0.5; exit 3; fi
trap 'echo "task 1: TERM ignored"' TERM
for i in $(seq 1 600); do sleep 0.1; done
"""


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_fake_srun_kills_a_task_still_running_after_kill_wait(tmp_path: Path) -> None:
    """Like srun --kill-on-bad-exit (slurmstepd's KillWait), the fake sends TERM, then KILL
    to a task still running, and exits with the failed task's status."""
    env = {**os.environ, "FAKE_SLURM_KILL_WAIT": "2"}
    env.pop("FAKE_SLURM_DIR", None)
    # Left running, task 1 would take 60 s: past the timeout, which fails the test.
    out = subprocess.run(
        [str(FAKE_SLURM / "srun"), "--nodes=2", "--kill-on-bad-exit=1", "bash", "-c",
         _STUBBORN_TASK], env=env, capture_output=True, text=True, timeout=40,
    )  # fmt: skip
    assert out.returncode == 3, out.stdout + out.stderr
    assert "task 1: TERM ignored" in out.stdout


@pytest.mark.slow
def test_template_outside_slurm_fails_clearly(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run(
        ["bash", "slurm/single_node.sbatch"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert out.returncode != 0
    assert "not inside a Slurm job: submit this script with sbatch" in out.stderr


@pytest.mark.slow
def test_preflight_failure_stops_the_job_before_srun(slurm_env) -> None:
    env, _ = slurm_env
    env["GPUS_PER_NODE"] = "3"
    out = subprocess.run(
        [str(FAKE_SLURM / "sbatch"), "slurm/single_node.sbatch", "rollout.tp=2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert "error: rollout.tp(2) does not divide the world size 3" in out.stderr
    assert "the preflight plan failed" in out.stderr
    assert not (Path(env["FAKE_SLURM_DIR"]) / "srun.log").exists()


@pytest.mark.slow
def test_torchrun_launcher_dry_run() -> None:
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}",
           "PLAN": "1", "NPROC": "2", "PYTHON": sys.executable}  # fmt: skip
    out = subprocess.run(
        ["launchers/torchrun.sh", "grpo.batch.prompts_per_step=2"], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "placement    colocated: train ranks 0-1, rollout ranks 0-1" in out.stdout


FAKE_TORCHRUN = """#!/usr/bin/env bash
# Stand-in for torchrun (this test only): records its arguments, waits for the warning
# signal, then saves step 2 (FAKE_SAVE=1) as the trainer would, and exits 1 as the real
# torchrun does after any signal it handled (torch/distributed/run.py: SignalException).
printf '%s\\n' "$*" >>"$FAKE_SLURM_DIR/torchrun.log"
on_usr1() {
    sleep 1.1  # the save comes after the warning, at the end of the current step
    if [[ "$FAKE_SAVE" == 1 ]]; then echo step_000002 >"$RUN_DIR/checkpoints/latest.tmp"
        mv "$RUN_DIR/checkpoints/latest.tmp" "$RUN_DIR/checkpoints/latest"; fi
    exit 1
}
trap on_usr1 USR1
touch "$FAKE_SLURM_DIR/torchrun.started"
while :; do sleep 0.1; done
"""


@pytest.mark.timeout(120)
@pytest.mark.slow
@pytest.mark.parametrize(
    "save,restarts,requeued,exit_code",
    [
        (True, 0, True, 0),  # a checkpoint completed after the warning: requeue
        (False, 0, False, 1),  # no save after the warning (it failed): no requeue
        (True, 2, False, 3),  # MAX_REQUEUES=2 reached: stop
    ],
)
def test_requeue_only_after_a_save_and_within_the_bound(
    slurm_env, tmp_path: Path, save, restarts, requeued, exit_code
) -> None:
    env, jobs = slurm_env
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(FAKE_TORCHRUN)
    (bin_dir / "torchrun").chmod(0o755)
    run_dir = Path(env["RUN_DIR"])
    # Step 1 of 10 saved before this job: the run is not complete.
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step_000001")
    os.utime(run_dir / "checkpoints" / "latest", (time.time() - 60, time.time() - 60))
    (run_dir / "config.yaml").write_text("steps: 10\n")
    env.update(
        TORCHRUN=str(bin_dir / "torchrun"), PREFLIGHT="0", FAKE_SAVE="1" if save else "0",
        SLURM_RESTART_COUNT=str(restarts), MAX_REQUEUES="2", SLURM_CPUS_PER_TASK="7",
        CONTAINER_IMAGE="/images/megatron-grpo.sqsh",
    )  # fmt: skip
    job = Job(["slurm/single_node.sbatch", "steps=10"], env, tmp_path / "job.log")
    jobs.append(job)
    state = Path(env["FAKE_SLURM_DIR"])
    job.wait_for(lambda: (state / "torchrun.started").exists(), 60, "the fake torchrun")
    os.kill(job.proc.pid, signal.SIGUSR1)
    assert job.wait(60) == exit_code, job.text()
    assert _requeued(env) == ([env["SLURM_JOB_ID"]] if requeued else []), job.text()
    srun = (state / "srun.log").read_text()
    assert "--label" in srun and "--cpus-per-task=7" in srun, srun
    assert "--container-image=/images/megatron-grpo.sqsh" in srun, srun
    assert f"--container-mounts={REPO}:{REPO}" in srun, srun
    torchrun = (state / "torchrun.log").read_text()
    assert f"--log-dir={env['LOG_DIR']} --tee=3" in torchrun, torchrun


RECORDING_TORCHRUN = """#!/usr/bin/env bash
# Stand-in for torchrun (this test only): records its arguments and succeeds.
printf '%s\\n' "$*" >>"$FAKE_SLURM_DIR/torchrun.log"
"""


@pytest.mark.timeout(120)
@pytest.mark.slow
@pytest.mark.parametrize("max_restarts", [None, "5", "x"])
def test_launchers_pass_max_restarts_and_resume_auto(slurm_env, tmp_path: Path, max_restarts):
    """Every launch carries `train --resume auto`, so torchrun's in-job restarts (and a
    requeue) resume from the latest checkpoint: MAX_RESTARTS defaults to 2 under Slurm (one
    node or several) and to 0 with launchers/torchrun.sh; a value that is not a count is
    refused in one line."""
    env, jobs = slurm_env
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(RECORDING_TORCHRUN)
    (bin_dir / "torchrun").chmod(0o755)
    env.update(TORCHRUN=str(bin_dir / "torchrun"), PREFLIGHT="0")
    if max_restarts is not None:
        env["MAX_RESTARTS"] = max_restarts
    job = Job(["slurm/single_node.sbatch", "steps=10"], env, tmp_path / "job.log")
    jobs.append(job)
    rc = job.wait(60)
    one = subprocess.run(["launchers/torchrun.sh", "steps=10"], cwd=REPO,
                         env={**env, "NPROC": "2"},
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    if max_restarts == "x":
        assert rc == 2 and "error: MAX_RESTARTS=x: use a number >= 0." in job.text(), job.text()
        assert one.returncode == 2 and one.stderr.strip() == (
            "error: MAX_RESTARTS=x: use a number >= 0."
        ), one.stderr
        return
    assert rc == 0 and one.returncode == 0, job.text() + one.stderr
    log = Path(env["FAKE_SLURM_DIR"]) / "torchrun.log"
    slurm_line, node_line = log.read_text().splitlines()
    assert f"--max-restarts={max_restarts or 2} " in slurm_line, slurm_line
    assert f"--max-restarts={max_restarts or 0} " in node_line, node_line
    for line in (slurm_line, node_line):
        assert " train " in line and " --resume auto steps=10" in line, line
    # Several nodes: the same default, each node's torchrun started with it.
    log.unlink()
    multi = Job(["--nodes=2", "slurm/multi_node.sbatch", "steps=10"], env, tmp_path / "job2.log")
    jobs.append(multi)
    assert multi.wait(60) == 0, multi.text()
    lines = log.read_text().splitlines()
    assert len(lines) == 2, lines
    assert all(f"--max-restarts={max_restarts or 2} " in x for x in lines), lines
