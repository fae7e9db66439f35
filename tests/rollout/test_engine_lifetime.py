"""A standalone vLLM engine (the disaggregated placement's, the judge's) leaves nothing behind
when the process that owns it is killed outright: vLLM's EngineCore process, its worker and
the resource tracker used to outlive a kill -9 (rollout/vllm_setup.py
engine_core_dies_with_parent)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

OWNER = """
import os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
from megatron_grpo.rollout.engine import RolloutEngine
RolloutEngine(sys.argv[1], placement="disaggregated", max_model_len=128, cpu_kv_cache_gb=0.25)
print("READY", flush=True)
time.sleep(600)
"""


def descendants(pid: int) -> list[int]:
    rows = [line.split() for line in subprocess.run(
        ["ps", "-eo", "pid=,ppid="], capture_output=True, text=True, check=True).stdout.splitlines()]  # fmt: skip
    out, frontier = [], {pid}
    while frontier:
        frontier = {int(p) for p, pp in rows if int(pp) in frontier}
        out += sorted(frontier)
    return out


def alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(300)
def test_the_engine_core_dies_with_its_killed_owner(tiny_dir):
    owner = subprocess.Popen([sys.executable, "-c", OWNER, tiny_dir], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    kids: list[int] = []
    try:
        assert owner.stdout is not None
        for line in owner.stdout:
            if "READY" in line:
                break
        kids = descendants(owner.pid)
        assert len(kids) >= 2, kids  # the engine core and its worker (and a tracker)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(alive(k) for k in kids):
            time.sleep(0.2)
        left = [k for k in kids if alive(k)]
        assert not left, f"processes of the killed engine's owner still alive: {left}"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        for k in kids:  # only what this test started, by pid
            if alive(k):
                os.kill(k, signal.SIGKILL)
