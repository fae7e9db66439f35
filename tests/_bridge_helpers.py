"""The bridge's single-process reference executor, which the transport tests compare with."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megatron_grpo.bridge.plan import SyncPlan
from megatron_grpo.bridge.transport import wire_dtype


def apply_plan_locally(
    plan: SyncPlan,
    sources: Mapping[int, Mapping[str, torch.Tensor]],
    dtype: torch.dtype | None = None,
) -> dict[tuple[int, str], torch.Tensor]:
    """Every destination shard built in one process, copy by copy.

    ``sources[rank][src_name]`` are the trainer shards; returns ``{(rank, name): tensor}``,
    zero where no copy writes (vocabulary padding).
    """
    dtype = dtype or wire_dtype(plan.element_size)
    out = {(d.rank, d.name): torch.zeros(d.shape, dtype=dtype) for d in plan.dst_tensors}
    for c in plan.copies:
        src = sources[c.src_rank][c.src_name].narrow(c.dim, c.src_start, c.length)
        out[(c.dst_rank, c.dst_name)].narrow(c.dim, c.dst_start, c.length).copy_(src)
    return out
