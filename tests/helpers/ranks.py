"""``run_spawned``: N spawned gloo processes for the transport and NCCL-rules tests, each
result sent back through a queue, every process this helper started joined or killed by its
own handle (never by name) before it returns; ranks leave with ``os._exit`` (a failed sync
leaves gloo operations pending that a teardown would wait on). The other tests use
tests/dist_utils.py (``spawn_ranks``)."""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import time

import torch

from megatron_grpo.distributed.spawn import free_port


def _worker(rank: int, world: int, port: int, fn, args: tuple, queue) -> None:
    import datetime
    import traceback

    import torch.distributed as dist

    from tests.nccl_rules import maybe_install

    try:
        maybe_install()  # NCCL's rules over gloo when MEGATRON_GRPO_NCCL_RULES is set
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        # torch.save bytes, not tensors: the queue would share tensor storage through file
        # descriptors that die with this process.
        buf = io.BytesIO()
        torch.save(fn(rank, world, *args), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        queue.close()
        queue.join_thread()
        # Skip interpreter teardown: a sync that failed leaves gloo operations pending,
        # and destroying the group would wait on them.
        os._exit(0)


def run_spawned(fn, world: int, args: tuple = (), timeout_s: float = 120.0) -> dict[int, object]:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned gloo processes; return results."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, fn, args, queue)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world)) - set(results) - set(errors))} gave no "
                    f"result within {timeout_s}s"
                )
            try:
                rank, status, value = queue.get(timeout=min(left, 1.0))
            except Exception:  # queue.Empty: check for dead children, then wait again
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a spawned rank died with exit codes {dead}") from None
                continue
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors[rank] = value
    finally:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
    if errors:
        raise AssertionError("\n".join(f"rank {r}:\n{tb}" for r, tb in sorted(errors.items())))
    return results
