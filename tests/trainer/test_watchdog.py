"""trainer/watchdog.py: a wait past its bound ends the process with one named line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from megatron_grpo.trainer.restarts import RESTARTS_FILE
from megatron_grpo.trainer.watchdog import EXIT_TIMEOUT, bounded

HANGS = """
import time
from megatron_grpo.trainer.watchdog import bounded
with bounded("the rollout of step 3", 0.5, "parallel.timeout_s bounds it"):
    time.sleep(60)
"""


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_hung_wait_exits_with_a_line_naming_the_phase():
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", HANGS], capture_output=True, text=True, timeout=50)
    assert out.returncode == EXIT_TIMEOUT and time.monotonic() - t0 < 40
    assert out.stderr.strip().splitlines()[-1] == (
        "error: rank 0: the rollout of step 3 did not finish within 0.5s (parallel.timeout_s "
        "bounds it): a peer rank or engine died or hangs; check train.log, then resume with "
        "--resume."
    )


def test_a_wait_that_ends_in_time_is_left_alone():
    fired = []
    with bounded("the sync", 0.2, "x", on_timeout=fired.append):
        pass
    time.sleep(0.4)
    assert fired == []


HANGS_IN_A_STEP = """
import sys, time
from megatron_grpo.trainer.watchdog import bounded_step
with bounded_step("the checkpoint of step 4", 0.5, sys.argv[1], 1, 4):
    time.sleep(60)
"""


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_hung_wait_of_a_step_is_that_steps_failure_for_the_restarted_attempt(tmp_path):
    """Under torchrun --max-restarts, the watchdog's exit records the step and the hang in
    restarts.jsonl as an exception would (the restarted attempt's line names them)."""
    env = {**os.environ, "RANK": "1", "TORCHELASTIC_MAX_RESTARTS": "2",
           "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_RUN_ID": "job7"}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", HANGS_IN_A_STEP, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=50)  # fmt: skip
    assert out.returncode == EXIT_TIMEOUT, out.stderr
    assert "error: rank 1: the checkpoint of step 4 did not finish within 0.5s" in out.stderr
    [record] = [json.loads(x) for x in (tmp_path / RESTARTS_FILE).read_text().splitlines()]
    assert record == {"run_id": "job7", "attempt": 0, "rank": 1, "step": 4, "cause":
                      "TimeoutError: the checkpoint of step 4 did not finish within 0.5s "
                      "(parallel.timeout_s)"}  # fmt: skip
