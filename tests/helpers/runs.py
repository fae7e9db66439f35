"""Real ``megatron-grpo train`` runs for the end-to-end tests: the small fast overrides
(``FAST``), one process (``train``) or under torchrun (``torchrun_train``, which also reports
the run's processes left alive), and metrics.jsonl rows compared step by step
(``assert_same_rows``), and a checkpoint's tensors (``final_weights``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.commands import cli

# A small, fast run: 4 prompts x 4 samples, 4 new tokens, one micro-batch.
FAST = [
    "grpo.group_size=4",
    "grpo.batch.prompts_per_step=4",
    "grpo.batch.micro_batch_size=16",
    "rollout.max_new_tokens=4",
    "rollout.cpu_kv_cache_gb=0.25",
    "model.warm_start_steps=20",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.plots=false",
]


# Keys that must agree between an uninterrupted run and a resumed one (no timings).
RESUME_KEYS = [
    "reward_mean", "reward_std", "pass_rate", "synced", "policy_version", "lag", "sync_bytes",
    "response_len_mean", "loss", "grad_norm", "lr", "ratio_mean", "entropy", "masked_frac",
]  # fmt: skip


def assert_same_rows(a: list[dict], b: list[dict]) -> None:
    """metrics.jsonl rows ``b`` equal ``a`` step by step on every RESUME_KEYS value."""
    for x, y in zip(a, b):
        for key in RESUME_KEYS:
            if isinstance(x[key], float):
                assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-6), (x["step"], key)
            else:
                assert y[key] == x[key], (x["step"], key)


def final_weights(run: Path, step: int) -> dict:
    """The policy's tensors (weights and optimizer state) in the checkpoint of ``step``."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run.parent / f"{run.name}_weights.pt"
    dcp_to_torch_save(run / "checkpoints" / f"step_{step:06d}" / "policy", out)
    return {k: v for k, v in torch.load(out, weights_only=False).items() if torch.is_tensor(v)}


def train(run_dir: Path, *args: str, timeout: int = 400) -> tuple[int, str]:
    return cli("train", "--run-dir", str(run_dir), *args, timeout=timeout)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def torchrun_train(
    run_dir: Path, *args: str, timeout: int, one_process: bool = False
) -> tuple[int, str, list[str]]:
    """(return code, output, processes of the run still alive 10 s after torchrun exited)
    of ``torchrun --nproc-per-node 2 -m megatron_grpo.cli.main train``, or with
    ``one_process`` of ``megatron-grpo train`` as one process, which starts torchrun itself
    for the ranks its layout needs."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.pop("WORLD_SIZE", None)
    launcher = [] if one_process else [
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
    ]  # fmt: skip
    cmd = [sys.executable, *launcher, "-m", "megatron_grpo.cli.main", "train",
           "--run-dir", str(run_dir), *args]  # fmt: skip
    # A session of its own: on timeout the whole tree (torchrun, ranks, vLLM) is killed.
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    left: list[str] = []
    try:
        out, _ = proc.communicate(timeout=timeout)
        deadline = time.monotonic() + 10
        while (left := _leftovers(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.5)
    except subprocess.TimeoutExpired:
        out = f"[test] killed after {timeout}s"
    finally:
        if proc.poll() is None or _leftovers(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.poll() is None:
            out = (proc.communicate()[0] or "") + out
    return proc.returncode, out, left


def _leftovers(session: int) -> list[str]:
    """Processes still alive in the launcher's session (vLLM engine cores, workers)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session and fields[0] != "Z":  # fields[3]: session id
            out.append(p.name)
    return out


def stopped_copy(full: Path, part: Path, step: int) -> None:
    """``part``: the finished run ``full`` as a run stopped after ``step`` leaves it, for a
    resume test: ``full``'s run directory with its checkpoints after ``step`` removed (it
    must have saved one at ``step``: ``checkpoint.interval``). The resume drops the
    metrics.jsonl rows after its checkpoint and runs those steps again, so ``full`` needs no
    second, interrupted run beside it."""
    shutil.copytree(full, part, symlinks=True)
    (part / "summary.json").unlink(missing_ok=True)  # a run stopped early writes none
    kept = []
    for ckpt in sorted((part / "checkpoints").glob("step_*")):
        if int(ckpt.name.split("_")[1]) > step:
            shutil.rmtree(ckpt)
        else:
            kept.append(int(ckpt.name.split("_")[1]))
    assert step in kept, f"{full} saved no checkpoint at step {step}: {kept}"
