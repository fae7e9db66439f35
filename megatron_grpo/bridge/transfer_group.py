"""The transfer group and the plan inputs: what both ends of a disaggregated sync share.

Disaggregated weights travel over a *transfer group* (``init_transfer_group``) spanning the
trainer ranks and the engine workers: group rank of trainer rank ``r`` = ``r``; group rank of
worker ``k`` of engine ``e`` = ``engines[e][k]`` (the global rank standing for it). Its ranks
are exactly the plan's ranks, so one ``SyncPlan`` and one ``Transport`` serve both sides: no
second wire format. Each worker *rebuilds* the plan from the same ``PlanInputs`` (sent at
init, ``vllm_plugin.TransferInitInfo.plan``) and runs the receiving half of the transport
(``worker_transport``); the build is deterministic, and the transport's fingerprint
handshake raises ``PlanMismatchError`` on the first sync if the two sides ever disagree.

Below both the trainer's sender (``bridge.weight_sync``) and the vLLM plugin
(``bridge.vllm_plugin``), which import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from megatron_grpo.bridge.plan import SyncPlan, build_plan
from megatron_grpo.bridge.transport import Transport
from megatron_grpo.config.schema import SyncConfig
from megatron_grpo.layouts.megatron import MegatronLayout
from megatron_grpo.models.spec import ModelSpec, load_spec


@dataclass(frozen=True)
class PlanInputs:
    """Everything that decides a sync's plan and transport, as plain values. Every trainer
    rank builds its own; a disaggregated engine's workers receive it as a dict
    (``to_dict``/``from_dict``) and rebuild the same plan."""

    model_dir: str
    layout: MegatronLayout
    """The trainer's layout (``MegatronLayout.of`` the trainer's context)."""
    rollout_tp: int
    engines: list[list[int]]
    """Global rank of each TP rank of each engine."""
    dtype: str
    """Wire dtype, e.g. ``float32`` (CPU) or ``bfloat16``."""
    bucket_mb: float
    timeout_s: float
    rollout_ep: bool = False
    """The engines run vLLM's expert parallelism (``rollout.expert_parallel``): each vLLM rank
    holds whole experts, only its own (``build_plan(rollout_ep=True)``)."""

    @classmethod
    def of(
        cls,
        model_dir: Any,
        ctx: Any,
        policy: Any,
        sync: SyncConfig,
        rollout_tp: int,
        engines: list[list[int]],
        rollout_ep: bool = False,
    ) -> PlanInputs:
        """This trainer rank's inputs: the layout of ``ctx`` (a ``ParallelContext``) with the
        norm naming, padded vocabulary and dtype of ``policy``'s shards."""
        shards = dict(policy.named_shards())
        dtype = next(iter(shards.values())).dtype
        return cls(
            model_dir=str(model_dir),
            layout=MegatronLayout.of(ctx, shards, policy.vocab_per_rank * ctx.tp),
            rollout_tp=rollout_tp, engines=engines, dtype=str(dtype).removeprefix("torch."),
            bucket_mb=sync.bucket_mb, timeout_s=sync.timeout_s, rollout_ep=rollout_ep,
        )  # fmt: skip

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> PlanInputs:
        engines = [list(map(int, e)) for e in d["engines"]]
        return cls(**{**d, "layout": MegatronLayout(**d["layout"]), "engines": engines})

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def build(self, spec: ModelSpec | None = None) -> SyncPlan:
        """The plan; ``spec`` is read from ``model_dir`` unless the caller has it."""
        element_size = torch.empty((), dtype=self.torch_dtype).element_size()
        return build_plan(
            spec or load_spec(self.model_dir), self.layout, self.rollout_tp, self.engines,
            element_size, rollout_ep=self.rollout_ep,
        )  # fmt: skip

    def transport(
        self, rank: int, group, device: torch.device | str, spec: ModelSpec | None = None
    ) -> Transport:
        return Transport(
            self.build(spec), rank, group=group, bucket_mb=self.bucket_mb,
            timeout_s=self.timeout_s, dtype=self.torch_dtype, device=device,
        )  # fmt: skip


_STORES: dict[int, Any] = {}


def init_transfer_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str = "gloo",
    timeout_s: float = 600.0,
) -> dist.ProcessGroup:
    """A process group spanning trainer ranks and vLLM workers, outside the default group.

    vLLM workers already own ``torch.distributed``'s default group (their TP world), and the
    trainer owns its own, so this group is built directly from a ``TCPStore`` (rank 0 hosts
    it). Trainer and workers call this with the same address, port and world size.
    """
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_address, master_port, world_size, is_master=rank == 0, timeout=timeout
    )
    prefix = dist.PrefixStore(f"megatron_grpo_transfer/{master_port}", store)
    # A Backend (torch's stubs: not a ProcessGroup) used as the group: isend/irecv call only
    # what both have.
    if backend == "gloo":
        pg = cast(dist.ProcessGroup, dist.ProcessGroupGloo(prefix, rank, world_size, timeout))
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = cast(dist.ProcessGroup, dist.ProcessGroupNCCL(prefix, rank, world_size, opts))
    else:
        raise ValueError(f"transfer backend {backend!r} must be 'gloo' (CPU) or 'nccl' (GPU).")
    _STORES[id(pg)] = store  # the group needs its store alive (pybind objects take no attrs)
    # torch.distributed's isend/irecv(group=pg, dst=global rank) translate the rank through
    # the registry of groups made by new_group (distributed_c10d.py: get_group_rank). This
    # group's ranks ARE the plan's ranks (trainer rank r -> r, engine workers -> their
    # engine ranks), so register it with the identity map: the bridge's Transport then runs
    # unchanged on it.
    dist.distributed_c10d._world.pg_group_ranks[pg] = {r: r for r in range(world_size)}
    return pg


def worker_transport(plan: Mapping, rank: int, group, device: torch.device | str) -> Transport:
    """Worker side: the receiving transport of group rank ``rank``, from the plan inputs."""
    inputs = PlanInputs.from_dict(plan)
    t = inputs.transport(rank, group, device)
    if not t.recv_links and not t.dst_shapes:
        raise RuntimeError(
            f"transfer rank {rank} receives nothing in the plan (engine ranks "
            f"{inputs.engines}): the worker's rank_offset does not match the rank placement."
        )
    return t
