"""The run directory before a run starts (trainer/run_dir.py) and the prepared model's
recipe (models/prepare.py): nothing a failed or earlier run left is trusted blindly, and
every rank of a launch refuses a bad one by itself."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import time

import pytest

from megatron_grpo.checkpoint import LoopState, save_checkpoint
from megatron_grpo.config import ConfigError, load_config
from megatron_grpo.distributed.spawn import free_port
from megatron_grpo.models.prepare import COMPLETE, prepare_model_dir
from megatron_grpo.trainer.run_dir import check_run_dir, clear_run_dir, plan_start
from tests.bad_inputs import ROOT, read_only_dir, snapshot


def prepare_run_dir(run, *, resume, overwrite):
    """What ``train`` does with the run directory on one process: check, then clear."""
    clear_run_dir(check_run_dir(run, resume=resume, overwrite=overwrite))


def test_a_finished_run_is_refused_unless_resume_or_overwrite(tmp_path):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)  # missing: fine (created later)
    (run / "hf_model").mkdir(parents=True)
    prepare_run_dir(run, resume=False, overwrite=False)  # a failed start's model: not a run
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    save_checkpoint(run, LoopState(step=8), save_rng=False)
    with pytest.raises(ConfigError, match=r"already holds a run \(checkpoints, metrics.jsonl\): "
                       "continue it with --resume, replace it with --overwrite"):  # fmt: skip
        prepare_run_dir(run, resume=False, overwrite=False)
    prepare_run_dir(run, resume=True, overwrite=False)
    with pytest.raises(ConfigError, match="contradict"):
        prepare_run_dir(run, resume=True, overwrite=True)
    prepare_run_dir(run, resume=False, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == ["hf_model"]
    with pytest.raises(ConfigError, match="--resume: no complete checkpoint under"):
        prepare_run_dir(run, resume=True, overwrite=False)


def test_resume_auto_resumes_a_checkpoint_else_starts_afresh_and_refuses_a_finished_run(tmp_path):
    run = tmp_path / "run"
    assert plan_start(run, resume="auto", overwrite=False).resume is False  # nothing there
    # A run that died before its first checkpoint: started afresh, its leftovers deleted
    # (not the prepared model, the log, or the restart records a restart reads).
    (run / "hf_model").mkdir(parents=True)
    for name in ("metrics.jsonl", "config.yaml", "restarts.jsonl", "train.log"):
        (run / name).write_text("{}\n")
    (run / "checkpoints" / "step_000002.tmp").mkdir(parents=True)  # a save killed midway
    start = plan_start(run, resume="auto", overwrite=False)
    assert start.resume is False
    assert sorted(p.name for p in start.stale) == ["checkpoints", "config.yaml", "metrics.jsonl"]
    clear_run_dir(start.stale)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    save_checkpoint(run, LoopState(step=2), save_rng=False)
    assert plan_start(run, resume="auto", overwrite=False) == plan_start(
        run, resume=True, overwrite=False
    )
    assert plan_start(run, resume="auto", overwrite=False).resume is True
    with pytest.raises(ConfigError, match="--resume auto and --overwrite contradict"):
        plan_start(run, resume="auto", overwrite=True)
    (run / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"holds a finished run \(summary.json\): nothing to "
                       "resume; replace it with --overwrite"):  # fmt: skip
        plan_start(run, resume="auto", overwrite=False)


def test_unusable_run_dirs_are_one_line(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        check_run_dir(f, resume=False, overwrite=False)
    with contextlib.ExitStack() as stack:
        ro = _enter_read_only(stack, tmp_path / "ro")
        with pytest.raises(ConfigError, match=re.escape(f"not writable (no write access to {ro})")):
            check_run_dir(ro / "run", resume=False, overwrite=False)


def _enter_read_only(stack, path):
    try:
        return stack.enter_context(read_only_dir(path))
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot make a read-only directory here (root without mount rights): {e}")


# Rank 1 as a test runs it: ``megatron-grpo`` with a file made once rank 1 waits to be
# stopped (cli/errors.py), so the test, playing torchrun, stops it then.
WAITING = (
    "import sys; from megatron_grpo.cli import errors, main; wait = errors._wait_to_be_stopped; "
    "mark = sys.argv.pop(1); errors._wait_to_be_stopped = lambda: (open(mark, 'w').close(), "
    "wait()); sys.exit(main.main(sys.argv[1:]))"
)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("run_dir", ["afile", "ro/run"])
def test_every_rank_refuses_a_bad_run_dir_by_itself(tmp_path, run_dir):
    """Both ranks as torchrun starts them (each its own process, RANK, WORLD_SIZE and
    MASTER_* set), the test playing torchrun: rank 0 refuses and exits 2 by itself with the
    one line; rank 1 refuses too, prints nothing and waits until it is stopped (SIGTERM,
    as torchrun stops the other ranks when one exits), then exits 2; no traceback, nothing
    is created or changed."""
    (tmp_path / "afile").write_text("x")
    why = {
        "afile": "is a file, not a directory: pass --run-dir a directory path (it is created "
        "when missing).",
        "ro/run": f"is not writable (no write access to {tmp_path / 'ro'}): pass --run-dir a "
        "directory you can write to.",
    }[run_dir]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    args = ["train", "--run-dir", str(tmp_path / run_dir)]
    waiting = tmp_path.parent / f"{tmp_path.name}.rank1.waiting"
    cmds = [
        [sys.executable, "-m", "megatron_grpo.cli.main", *args],
        [sys.executable, "-c", WAITING, str(waiting), *args],
    ]
    logs = [tmp_path.parent / f"{tmp_path.name}.rank{r}.log" for r in range(2)]
    with contextlib.ExitStack() as stack:
        if run_dir.startswith("ro/"):
            _enter_read_only(stack, tmp_path / "ro")
        before = snapshot(tmp_path)
        procs = []
        for r, log in enumerate(logs):
            with open(log, "w") as fh:
                rank_env = {**env, "RANK": str(r), "LOCAL_RANK": str(r)}
                procs.append(subprocess.Popen(cmds[r], env=rank_env, stdout=fh,
                                              stderr=subprocess.STDOUT))  # fmt: skip
        try:
            codes = [procs[0].wait(timeout=240)]
            while not waiting.exists() and procs[1].poll() is None:
                time.sleep(0.1)
            procs[1].terminate()  # what torchrun does once rank 0 has exited
            codes.append(procs[1].wait(timeout=60))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        after = snapshot(tmp_path)
    out = [log.read_text() for log in logs]
    assert codes == [2, 2] and waiting.exists(), out
    assert out == [f"error: run_dir={str(tmp_path / run_dir)!r} {why}\n", ""]
    assert after == before


def _md5(d):
    return hashlib.md5((d / "model.safetensors").read_bytes()).hexdigest()


def test_prepared_model_is_reused_only_for_the_same_recipe(tmp_path):
    cfg = load_config(None, [f"run_dir={tmp_path}", "model.warm_start_steps=0", "seed=1"])
    d = prepare_model_dir(cfg, 0, 10)
    first = _md5(d)
    assert json.loads((d / COMPLETE).read_text())["recipe"]["seed"] == 1
    assert _md5(prepare_model_dir(cfg, 0, 10)) == first  # same recipe: reused
    other = load_config(None, [f"run_dir={tmp_path}", "model.warm_start_steps=0", "seed=99"])
    with pytest.raises(TimeoutError, match="waited 0s for rank 0"):
        prepare_model_dir(other, 1, 0)  # other ranks never take the old recipe's model
    d = prepare_model_dir(other, 0, 10)
    assert _md5(d) != first and json.loads((d / COMPLETE).read_text())["recipe"]["seed"] == 99
