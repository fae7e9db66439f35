"""What ``bench throughput`` and ``bench reproduce`` share: the command line of one training
run, the logged process that runs it, the machine it ran on, and the trailing mean that
both the reproduce verdicts and the report's plots smooth reward curves with.

Every process started here is waited for, or killed through its own process group (its
id), before the function returns.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_grpo.config import load_config
from megatron_grpo.distributed.spawn import torchrun_argv

BENCH_OVERRIDES = (
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.plots=false",
    # The end-of-run checkpoint is saved inside the last step's time_step: keep it out.
    "checkpoint.save_at_end=false",
)
"""Applied before the user's overrides (which may set them back)."""


class BenchRunFailed(RuntimeError):
    """One ``megatron-grpo train`` run exited non-zero or ran past its time limit."""


def config_nproc(config: str | None, overrides: Sequence[str]) -> int:
    """Ranks the config's trainer layout needs: parallel.tp * pp * max(dp, 1)."""
    p = load_config(config, list(overrides)).parallel
    return p.tp * p.pp * max(p.dp, 1)


def train_argv(
    nproc: int,
    config: str | None,
    run_dir: Path,
    steps: int,
    sync_interval: int,
    overrides: Sequence[str],
) -> list[str]:
    """One benchmark run of ``megatron-grpo train`` (torchrun when ``nproc > 1``), with
    :data:`BENCH_OVERRIDES` and then ``overrides``."""
    if nproc > 1:
        launch = torchrun_argv(nproc)
    else:
        launch = [sys.executable, "-m", "megatron_grpo.cli.main"]
    # --overwrite: a re-run of the bench into the same out_dir replaces its runs.
    cmd = [*launch, "train", "--run-dir", str(run_dir), "--overwrite", "--steps", str(steps),
           "--sync-interval", str(sync_interval)]  # fmt: skip
    if config:
        cmd += ["--config", config]
    return cmd + [*BENCH_OVERRIDES, *overrides]


def run_logged(cmd: list[str], log_path: Path, timeout_s: float, threads: int,
               extra_env: Mapping[str, str] | None = None) -> float:  # fmt: skip
    """Run ``cmd`` in its own process group, output to ``log_path``; returns wall seconds."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", **(extra_env or {}))
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except BaseException:
            # Its own session: the group id is the pid we started (torchrun's ranks, vLLM's
            # workers and the reward pool are in it); nothing else is touched.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            raise
    if rc != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        raise BenchRunFailed(
            f"`{' '.join(cmd)}` exited with {rc}; its log is {log_path}. Last lines:\n"
            + "\n".join(tail)
        )
    return time.perf_counter() - t0


def loadavg() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def machine_info() -> dict[str, Any]:
    import platform

    info: dict[str, Any] = {"nproc": os.cpu_count(), "platform": platform.platform()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["mem_gib"] = round(int(line.split()[1]) / 2**20, 1)
                break
        info["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        pass
    return info


def format_table(
    titles: Sequence[Any],
    rows: Iterable[Sequence[Any] | str],
    widths: Sequence[int],
    sep: str = "",
    *,
    head: Sequence[str] = (),
    foot: Sequence[str] = (),
) -> str:
    """A bench command's console table, the one formatter they all use: the ``head`` lines
    (what ran), the column titles, one line per row, then the ``foot`` lines. A row is its
    cells (see :func:`columns`), or a str printed as it is (a line that spans the columns)."""
    lines = [*head, columns(titles, widths, sep)]
    lines += [r if isinstance(r, str) else columns(r, widths, sep) for r in rows]
    return "\n".join([*lines, *foot])


def columns(cells: Sequence[Any], widths: Sequence[int], sep: str = "") -> str:
    """One line of :func:`format_table`: each cell right-aligned in its width, a negative
    width left-aligned (the label column), a cell wider than its width printed whole."""
    return sep.join(
        str(c).ljust(-w) if w < 0 else str(c).rjust(w) for c, w in zip(cells, widths, strict=True)
    )


def write_json(res: Mapping[str, Any], path: str | os.PathLike) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(res, indent=2, default=str))


def trailing_mean(xs: Sequence[float], w: int) -> list[float]:
    """``out[i]`` = mean of ``xs[max(0, i-w+1) : i+1]``."""
    out, s = [], 0.0
    for i, x in enumerate(xs):
        s += x
        if i >= w:
            s -= xs[i - w]
        out.append(s / min(i + 1, w))
    return out


def package_versions(*names: str) -> dict[str, str | None]:
    """torch's version and each installed distribution's of ``names`` (None: not installed),
    for a benchmark's JSON."""
    import importlib.metadata as md

    import torch

    out: dict[str, str | None] = {"torch": torch.__version__}
    for name in names:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out
