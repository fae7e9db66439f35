"""quiet_torchrun (issue 47 item 3): torchrun's report left out when every rank refused
(exit 2), kept for any other failure. In-process, torchrun's main stubbed."""

from __future__ import annotations

import logging

import pytest
import torch.distributed.run as torch_run
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from megatron_grpo.distributed import quiet_torchrun
from megatron_grpo.distributed.spawn import torchrun_argv

API = "torch.distributed.elastic.multiprocessing.api"


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


def test_only_the_self_spawned_torchrun_is_quiet():
    assert torchrun_argv(2, "train")[2] == "torch.distributed.run"  # what a user types
    assert torchrun_argv(2, "train", quiet=True)[2] == "megatron_grpo.distributed.quiet_torchrun"
