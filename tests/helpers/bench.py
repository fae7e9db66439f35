"""Shared by tests/bench/test_bench_throughput.py and test_bench_reproduce.py: a very short real
training job, and ``megatron-grpo bench`` run as a subprocess that is waited for or killed
by its own process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

# A very short real run: 4 prompts x 4 samples, 4 new tokens (runs.FAST's first five).
FAST = [
    "grpo.group_size=4", "grpo.batch.prompts_per_step=4", "grpo.batch.micro_batch_size=16",
    "rollout.max_new_tokens=4", "rollout.cpu_kv_cache_gb=0.25",
]  # fmt: skip


def run_bench(*args: str, timeout: float) -> tuple[int, str]:
    """``megatron-grpo bench *args *FAST``: (exit code, output); past ``timeout`` seconds its
    own session (the bench and what it started in it) is killed."""
    cmd = [sys.executable, "-m", "megatron_grpo.cli.main", "bench", *args, *FAST]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)  # fmt: skip
    try:
        text, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, text
