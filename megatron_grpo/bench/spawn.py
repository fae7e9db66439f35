"""Run one function on N local ranks (spawned processes with torchrun's environment).

The bench launches its own processes so that ``megatron-grpo bench sync`` needs no
launcher. Results come back as ``torch.save`` files; every process started here is
joined, or killed by its own handle, before ``spawn_ranks`` returns (never by name).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


class RankFailed(RuntimeError):
    """A spawned rank raised, died, or ran past the time limit."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    fn: Callable, rank: int, world: int, port: int, out: str, env: dict, args: tuple
) -> None:
    from megatron_grpo.platform.lifetime import die_with_parent

    die_with_parent()  # a killed `eval` / `bench` must not leave its ranks behind
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env,
    )  # fmt: skip
    import torch

    try:
        result = fn(rank, world, *args)
        tmp = Path(out) / f"{rank}.pt.tmp"
        torch.save(result, tmp)
        tmp.rename(Path(out) / f"{rank}.pt")
    except BaseException:  # noqa: BLE001 - reported to the parent through the file
        (Path(out) / f"{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    # Skip teardown: vLLM and gloo threads may hold the interpreter at exit.
    os._exit(0)


def spawn_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout_s: float = 1800.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned ranks; their results in rank order."""
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = []
    with tempfile.TemporaryDirectory(prefix="mgrpo_bench_") as out:
        try:
            for r in range(world):
                p = ctx.Process(target=_entry, args=(fn, r, world, port, out, env or {}, args))
                p.start()
                procs.append(p)
            deadline = time.monotonic() + timeout_s
            while any(p.is_alive() for p in procs):
                errs = sorted(Path(out).glob("*.err"))
                if errs:
                    raise RankFailed(f"rank {errs[0].stem} failed:\n{errs[0].read_text()}")
                dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
                if dead:
                    raise RankFailed(f"ranks died (rank: exit code) {dead}")
                if time.monotonic() > deadline:
                    raise RankFailed(f"ranks ran past {timeout_s:.0f}s and were killed")
                time.sleep(0.1)
            errs = sorted(Path(out).glob("*.err"))
            if errs:
                raise RankFailed(f"rank {errs[0].stem} failed:\n{errs[0].read_text()}")
            missing = [r for r in range(world) if not (Path(out) / f"{r}.pt").exists()]
            if missing:
                codes = {r: procs[r].exitcode for r in missing}
                raise RankFailed(f"ranks {missing} returned no result (exit codes {codes})")
            return [torch.load(Path(out) / f"{r}.pt", weights_only=False) for r in range(world)]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
