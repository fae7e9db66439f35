"""quiet_torchrun (issue 47 item 3): torchrun's report left out when every rank refused
(exit 2), kept for any other failure. In-process, torchrun's main stubbed."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import pytest
import torch.distributed.run as torch_run
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from megatron_grpo.distributed import quiet_torchrun
from megatron_grpo.distributed.spawn import torchrun_argv

API = "torch.distributed.elastic.multiprocessing.api"
TAIL = "torch.distributed.elastic.multiprocessing.tail_log"


def _fake_torchrun(*codes: int):
    def main(argv):
        log = logging.getLogger(API)
        log.warning("Sending process %s closing signal %s", 11, "SIGTERM")
        log.error("failed (exitcode: %s) local_rank: %s", codes[0], 0)
        failures = {r: ProcessFailure(r, 100 + r, c, "<N/A>") for r, c in enumerate(codes)}
        raise ChildFailedError("megatron_grpo.cli.main", failures)

    return main


def test_refusal_is_quiet_and_other_failures_keep_the_report(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=API)
    monkeypatch.setattr(torch_run, "main", _fake_torchrun(2, 2))
    assert quiet_torchrun.main([]) == 2
    assert caplog.records == []  # torchrun's stop lines held back, then dropped

    monkeypatch.setattr(torch_run, "main", _fake_torchrun(1, 2))
    with pytest.raises(ChildFailedError):
        quiet_torchrun.main([])
    assert [r.getMessage() for r in caplog.records] == [
        "Sending process 11 closing signal SIGTERM",
        "failed (exitcode: 1) local_rank: 0",
    ]
    assert not logging.getLogger(API).filters  # the filter does not outlive the call


def test_a_rank_torchrun_stopped_after_the_refusal_is_not_a_cause(monkeypatch, caplog):
    """Rank 0 refused while rank 1 was still importing: torchrun stopped rank 1 itself (its
    exit -15 is in the failures beside rank 0's 2). Still the refusal; a rank that failed
    on its own with another code is not."""

    def stopped_one(other: int):
        def main(argv):
            log = logging.getLogger(API)
            log.warning("Sending process %s closing signal %s", 101, "SIGTERM")
            log.error("failed (exitcode: %s) local_rank: %s", 2, 0)
            failures = {0: ProcessFailure(0, 100, 2, "<N/A>"), 1: ProcessFailure(1, 101, -15, "<N/A>"),
                        2: ProcessFailure(2, 102, other, "<N/A>")}  # fmt: skip
            raise ChildFailedError("megatron_grpo.cli.main", failures)

        return main

    caplog.set_level(logging.INFO, logger=API)
    monkeypatch.setattr(torch_run, "main", stopped_one(2))
    assert quiet_torchrun.main([]) == 2
    assert caplog.records == []
    monkeypatch.setattr(torch_run, "main", stopped_one(-9))  # rank 2 killed by someone else
    with pytest.raises(ChildFailedError):
        quiet_torchrun.main([])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_refusal_before_the_other_rank_is_ready_is_quiet_under_real_torchrun(tmp_path):
    """The race CI met (launchers/cpu_demo.sh): rank 0 exits 2 while rank 1 is still busy, so
    torchrun sends rank 1 SIGTERM. Real torchrun, two ranks: nothing but rank 0's line."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['LOCAL_RANK'] == '0':\n"
        "    print('error: refused.', file=sys.stderr); sys.exit(2)\n"
        "time.sleep(100)\n"
    )
    argv = [sys.executable, "-m", "megatron_grpo.distributed.quiet_torchrun", "--standalone",
            "--nproc-per-node=2", str(script)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=100, env=env)
    assert (out.returncode, out.stdout, out.stderr) == (2, "", "error: refused.\n")


def test_a_signal_that_stops_torchrun_is_one_line(monkeypatch, caplog, capsys):
    """srun's TERM to a node whose ranks did not refuse yet (another node's torchrun exited 2),
    or a scancel: one line and exit 1 (torchrun's own status then), no SignalException trace."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def stopped(argv):
        logging.getLogger(API).warning("Sending process %s closing signal %s", 11, "SIGTERM")
        stop = SignalException("Process 7 got signal: 15", sigval=signal.SIGTERM)
        try:  # torchrun's log tailer (--tee) logs the exception's traceback as it stops
            raise stop
        except SignalException:
            logging.getLogger(TAIL).exception("error in log tailer for %s%s", "default", 0)
        raise stop

    caplog.set_level(logging.INFO, logger=API)
    caplog.set_level(logging.INFO, logger=TAIL)
    monkeypatch.setattr(torch_run, "main", stopped)
    assert quiet_torchrun.main([]) == 1
    said = capsys.readouterr().err
    assert said == "torchrun: stopped by SIGTERM; its ranks were sent SIGTERM too\n"
    assert [r.getMessage() for r in caplog.records] == ["Sending process 11 closing signal SIGTERM"]
    assert not logging.getLogger(TAIL).filters


def test_a_signal_after_the_ranks_refused_is_the_refusal(monkeypatch, caplog, capsys):
    """Two nodes, every rank refused: the other node's torchrun exited first and srun's TERM
    reached this one while it was ending, after it had seen its ranks exit 2. The job's
    status is srun's first node's, so this is still the refusal: exit 2, nothing said."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def ending(argv):
        log = logging.getLogger(API)
        log.warning("Sending process %s closing signal %s", 11, "SIGTERM")
        log.error("failed (exitcode: %s) local_rank: %s", 2, 0)
        raise SignalException("Process 7 got signal: 15", sigval=signal.SIGTERM)

    caplog.set_level(logging.INFO, logger=API)
    monkeypatch.setattr(torch_run, "main", ending)
    assert quiet_torchrun.main([]) == 2
    assert capsys.readouterr().err == "" and caplog.records == []


def test_a_lost_rendezvous_is_one_line(monkeypatch, capsys):
    """Another node's torchrun held the store and exited (its ranks refused): one line."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    def lost(argv):
        raise RendezvousConnectionError("The connection to the C10d store has failed.")

    monkeypatch.setattr(torch_run, "main", lost)
    assert quiet_torchrun.main([]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "torchrun: lost the rendezvous (RendezvousConnectionError: The connection to the C10d "
        "store has failed.): the node holding its store stopped (see the other nodes' lines) "
        "or --rdzv-endpoint is wrong"
    ]


def test_only_the_self_spawned_torchrun_is_quiet():
    assert torchrun_argv(2, "train")[2] == "torch.distributed.run"  # what a user types
    assert torchrun_argv(2, "train", quiet=True)[2] == "megatron_grpo.distributed.quiet_torchrun"
