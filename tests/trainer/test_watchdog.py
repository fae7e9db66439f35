"""trainer/watchdog.py: a wait past its bound ends the process with one named line."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

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
