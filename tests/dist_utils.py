"""Run a function in N spawned gloo processes and collect what each rank returns.

    results = run_distributed(fn, world_size, *args, timeout=120.0)

The tests' conveniences on top of the one rank spawner,
``megatron_grpo.distributed.spawn.spawn_ranks`` (which says how ranks are started, how
results come back, and that every process started is joined before the call returns): one
torch thread per rank by default (2-core CI machines), a short timeout, and NCCL's rules
emulated over gloo in every rank when ``MEGATRON_GRPO_NCCL_RULES`` is set
(``tests/nccl_rules.py``). ``fn(rank, world_size, *args)`` must be a module-level
(picklable) function; a failed rank or a timeout raises ``RankFailed``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_grpo.distributed.spawn import spawn_ranks
from tests.nccl_rules import maybe_install


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    threads: int = 1,
    result_types: tuple[type, ...] = (),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return results
    (plain data, and instances of ``result_types``: ``spawn_ranks``)."""
    return spawn_ranks(
        fn, world_size, *args, timeout_s=timeout, threads=threads, setup=maybe_install,
        result_types=result_types,
    )  # fmt: skip
