"""In-job restarts' records (trainer/restarts.py): the restarted attempt's line, and the one
line of a restart loop, printed by the rank whose failure came first on the last attempt."""

from __future__ import annotations

from megatron_grpo.trainer.restarts import RESTARTS_FILE, Attempt, record_failure, restart_line


def test_attempt_reads_torchruns_environment(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS", raising=False)
    assert Attempt.current() is None  # not under torchrun
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert Attempt.current() is None  # nothing restarts
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    assert Attempt.current() == Attempt(1, 2, "job7")
    assert not Attempt(1, 2, "job7").last and Attempt(2, 2, "job7").last


def test_across_nodes_the_attempt_is_the_agreed_one_and_the_last_is_the_nodes(monkeypatch):
    """A node whose ranks did not fail keeps its TORCHELASTIC_RESTART_COUNT: the attempt is
    the one agreed through the store (distributed/setup.py), and whether no restart is left
    is this node's torchrun's count, the one that stops the job."""
    from megatron_grpo.distributed import setup

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.setattr(setup, "_job_attempt", 2)
    attempt = Attempt.current()
    assert attempt == Attempt(2, 2, "job7", node_restarts=0) and not attempt.last
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert Attempt.current() == Attempt(2, 2, "job7") and Attempt(2, 2, "job7").last


def test_a_restart_loop_ends_with_one_line_naming_the_step_and_the_cause(tmp_path):
    run = tmp_path / "run"
    boom = RuntimeError("CUDA error: an illegal memory access\nsecond line")
    first, last = Attempt(0, 1, "job7"), Attempt(1, 1, "job7")
    other_job = Attempt(0, 1, "job6")  # an earlier job in the same run directory
    assert record_failure(run, other_job, 0, 9, ValueError("old")) is None
    assert record_failure(run, first, 1, 5, boom) is None  # a restart is left
    assert record_failure(run, first, 0, 5, RuntimeError("peer gone")) is None
    assert restart_line(run, last, 4) == (
        "restart 1 of 1: the previous attempt failed at step 5 (RuntimeError: CUDA error: an "
        "illegal memory access); continuing from step 4; 0 finished step(s) redone"
    )
    line = record_failure(run, last, 1, 5, boom)
    assert line == (
        "error: restart loop: step 5 failed on each of the 2 attempts (MAX_RESTARTS=1), last "
        "with RuntimeError: CUDA error: an illegal memory access: stopping; fix the cause, "
        "then launch again (--resume auto continues from the latest checkpoint)."
    )
    # The peer that fails after it (a collective with a dead rank) prints nothing.
    assert record_failure(run, last, 0, 5, RuntimeError("peer gone")) is None
    assert len((run / RESTARTS_FILE).read_text().splitlines()) == 5


def test_the_loop_line_names_each_attempts_step_when_they_differ(tmp_path):
    run = tmp_path / "run"
    record_failure(run, Attempt(0, 1, "j"), 0, 3, OSError("disk full"))
    line = record_failure(run, Attempt(1, 1, "j"), 0, 7, OSError("disk full"))
    assert line is not None and line.startswith(
        "error: restart loop: steps 3, 7 failed on the 2 attempts (MAX_RESTARTS=1), last with "
        "OSError: disk full"
    )
