"""The resharding bridge into *disaggregated* vLLM engines: same plan, same transport.

Disaggregated placement (``megatron_grpo.plan.placement.place_ranks``): the first
``n_train`` torchrun ranks train, the last ``num_engines * rollout.tp`` ranks each stand for
one TP rank of a vLLM engine whose workers are separate processes (vLLM's own executor).
Weights travel over a *transfer group* that spans the trainer ranks and the engine workers:

- group rank of trainer rank ``r`` = ``r``; group rank of worker ``k`` of engine ``e`` =
  ``engines[e][k]`` (the global rank standing for it). The group therefore has WORLD_SIZE
  ranks and its ranks are exactly the ranks of the plan (``build_plan(..., engines)``), so
  one ``SyncPlan`` and one ``Transport`` serve both sides: no second wire format.
- trainer ranks run ``Transport.sync(shards)`` (sending half); each worker runs
  ``Transport.sync({}, sink=receiver.receive_shard)`` (receiving half) inside vLLM's reload
  protocol (``start_weight_update / update_weights / finish_weight_update``,
  ``vllm/v1/worker/gpu_worker.py``), in ``vllm_plugin.MegatronShardTransferEngine``.
- the worker *rebuilds* the plan from the same inputs (``PlanInputs``: model directory,
  trainer layout, rollout TP, engine ranks, wire dtype) instead of receiving it: the build
  is deterministic, and the transport's fingerprint handshake raises ``PlanMismatchError``
  on the first sync if the two sides ever disagree.

The control messages that start an update on the engines (and report its end) are the
rollout layer's (``megatron_grpo.rollout.server``); this module sees them as two callables.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

import torch

from megatron_grpo.bridge.accounting import SyncReport
from megatron_grpo.bridge.plan import TrainerPlacement, build_plan
from megatron_grpo.bridge.plan_types import SyncPlan
from megatron_grpo.bridge.transport import Transport


@dataclass(frozen=True)
class PlanInputs:
    """Everything ``build_plan`` and ``Transport`` need, as plain values (sent to workers)."""

    model_dir: str
    tp: int
    pp: int
    vpp: int
    dp: int
    norm_style: str
    padded_vocab: int
    rollout_tp: int
    engines: list[list[int]]
    dtype: str
    """Wire dtype, e.g. ``float32`` (CPU) or ``bfloat16``."""
    bucket_mb: float
    timeout_s: float

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> PlanInputs:
        return cls(**{**d, "engines": [list(map(int, e)) for e in d["engines"]]})

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def build(self) -> SyncPlan:
        from megatron_grpo.models.spec import load_spec

        placement = TrainerPlacement(
            tp=self.tp, pp=self.pp, vpp=self.vpp, dp=self.dp,
            norm_style=self.norm_style,  # type: ignore[arg-type]
            padded_vocab=self.padded_vocab,
        )  # fmt: skip
        element_size = torch.empty((), dtype=self.torch_dtype).element_size()
        return build_plan(
            load_spec(self.model_dir), placement, self.rollout_tp, self.engines, element_size
        )

    def transport(self, rank: int, group, device: torch.device | str) -> Transport:
        return Transport(
            self.build(), rank, group=group, bucket_mb=self.bucket_mb,
            timeout_s=self.timeout_s, dtype=self.torch_dtype, device=device,
        )  # fmt: skip


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


class RemoteWeightSync:
    """Trainer side of a disaggregated sync; the same face as ``WeightSync``.

    ``begin()`` asks every engine to enter ``update_weights`` (its workers then block in
    the receiving half of the transport); ``end()`` waits until every engine finished its
    reload (vLLM's post-load processing: the sync's ``finish`` phase). Trainer rank 0 passes
    both; the other trainer ranks only send and pass None.
    """

    def __init__(
        self,
        inputs: PlanInputs,
        rank: int,
        group,
        device: torch.device | str,
        begin: Callable[[], None] | None,
        end: Callable[[], float | None] | None,
    ) -> None:
        self.inputs = inputs
        self.transport = inputs.transport(rank, group, device)
        self.plan = self.transport.plan
        self.minimal_bytes = self.plan.minimal_bytes
        self._begin, self._end = begin, end
        self.syncs = 0

    def sync(self, policy) -> SyncReport:
        """Collective over the trainer ranks (and the engines' workers)."""
        return self.sync_shards(dict(policy.named_shards()))

    def sync_shards(self, shards: Mapping[str, torch.Tensor]) -> SyncReport:
        from megatron_grpo.bridge.weight_sync import merge_over_ranks

        if self._begin is not None:
            self._begin()
        with torch.no_grad():
            stats, _ = self.transport.sync(shards, sink=None, finish=self._end)
        self.syncs += 1
        return merge_over_ranks(stats)
