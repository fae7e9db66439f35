"""Run a function in N spawned gloo processes and collect what each rank returns.

    results = run_distributed(fn, world_size, *args, timeout=120.0)

``fn(rank, world_size, *args)`` must be a module-level (picklable) function; it runs in a
fresh ``spawn`` process with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1 and a free
MASTER_PORT set, one torch thread (2-core CI machines), and returns any picklable value.
Results come back through files in a temporary directory, in rank order. If a rank raises,
the other ranks are killed and ``DistributedTestError`` carries that rank's traceback; past
``timeout`` seconds every rank is killed and the error says which ones were still running.
Every process started here is joined before the call returns, whatever happens.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


class DistributedTestError(RuntimeError):
    """A spawned rank failed or the group ran past its timeout."""


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    fn: Callable, rank: int, world_size: int, port: int, out_dir: str, threads: int, args: tuple
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=str(threads),
    )
    import torch

    from tests.nccl_rules import maybe_install

    maybe_install()  # NCCL's rules over gloo when MEGATRON_GRPO_NCCL_RULES is set
    torch.set_num_threads(threads)
    out = Path(out_dir)
    try:
        result = fn(rank, world_size, *args)
    except BaseException:
        (out / f"{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1) from None
    tmp = out / f"{rank}.pkl.tmp"
    tmp.write_bytes(pickle.dumps(result))
    tmp.rename(out / f"{rank}.pkl")


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, threads: int = 1
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return results."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs: list = []
    with tempfile.TemporaryDirectory(prefix="dist_test_") as out_dir:
        try:
            for rank in range(world_size):
                p = ctx.Process(
                    target=_worker,
                    args=(fn, rank, world_size, port, out_dir, threads, args),
                    daemon=False,
                )
                p.start()
                procs.append(p)
            deadline = time.monotonic() + timeout
            while any(p.is_alive() for p in procs):
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed:
                    break
                if time.monotonic() > deadline:
                    alive = [r for r, p in enumerate(procs) if p.is_alive()]
                    raise DistributedTestError(
                        f"{fn.__name__} on {world_size} ranks ran past {timeout}s; ranks "
                        f"{alive} were still running and were killed."
                    )
                time.sleep(0.05)
            errors = sorted(Path(out_dir).glob("*.err"))
            if errors:
                first = errors[0]
                raise DistributedTestError(
                    f"rank {first.stem} of {world_size} failed in {fn.__name__}:\n"
                    + first.read_text()
                )
            bad = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
            if bad:
                raise DistributedTestError(f"ranks exited abnormally (rank: exit code) {bad}")
            results = []
            for rank in range(world_size):
                path = Path(out_dir) / f"{rank}.pkl"
                results.append(pickle.loads(path.read_bytes()))
            return results
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
