"""quiet_torchrun (issue 47 item 3): torchrun's report left out when every rank refused
(exit 2), kept for any other failure. In-process, torchrun's main stubbed."""

from __future__ import annotations

import logging
import signal

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
