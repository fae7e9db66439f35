"""The trainer's handle on the resharding bridge: push the policy's shards into vLLM.

Design: docs/bridge.md, "The trainer's handle: WeightSender (bridge/weight_sync.py)".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megatron_grpo.bridge.accounting import SyncReport, SyncStats
from megatron_grpo.bridge.baseline import BaselineSync
from megatron_grpo.bridge.checksum import Checksum, checksum
from megatron_grpo.bridge.plan import SyncPlan
from megatron_grpo.bridge.transfer_group import PlanInputs
from megatron_grpo.bridge.transport import Deliver, Transport
from megatron_grpo.bridge.verify import verify_sync
from megatron_grpo.config.schema import SyncConfig
from megatron_grpo.models.spec import ModelSpec
from megatron_grpo.platform.cpu import device_mode_suspended

Verify = Callable[[Any, dict | None], dict]
"""``(policy, checksums of what this rank's vLLM receiver was sent) -> figures``: the
``sync.verify`` checks (``bridge.verify.verify_sync``); raises when a check fails."""


# ---------------------------------------------------------------------------- senders
class WeightSender(Protocol):
    """What the trainer holds to push its weights into the rollout engines."""

    plan: SyncPlan
    """The direct plan of this layout (``plan.minimal_bytes``: what a sync must deliver)."""
    syncs: int
    """Syncs run so far."""
    last_verify: dict | None
    """``sync.verify``: the figures of the latest sync's checks; None when not verifying."""

    def push(self, policy: Any) -> SyncReport:
        """Push ``policy``'s weights into every vLLM rank. Collective over the trainer ranks
        (and the engines' workers); returns the merged report of all ranks (bytes summed over
        senders, phase times of the slowest rank)."""
        ...


class LocalEngine:
    """Colocated sink: this rank's in-process vLLM TP rank (a ``RolloutEngine``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.finish = engine.finish_weight_update
        """Closes vLLM's reload session (post-load processing); returns its seconds."""

    def begin(self, record_checksums: bool) -> Deliver:
        return self.engine.begin_weight_update(record_checksums=record_checksums).receive_shard

    def done(self, stats: SyncStats) -> None:
        self.engine.update_phases(stats)


class RemoteEngines:
    """Disaggregated sink: this rank only sends. ``begin()`` asks every engine to enter
    ``update_weights`` (its workers then block in the receiving half of the transport);
    ``end()`` waits until every engine finished its reload (vLLM's post-load processing:
    the sync's ``finish`` phase). Trainer rank 0 passes both; the other ranks pass None."""

    def __init__(
        self, begin: Callable[[], None] | None, end: Callable[[], float | None] | None
    ) -> None:
        self._begin = begin
        self.finish = end

    def begin(self, record_checksums: bool) -> None:
        if self._begin is not None:
            self._begin()

    def done(self, stats: SyncStats) -> None:
        pass


class _SenderBase:
    """The part of ``WeightSender`` both implementations share: after this rank's half of a
    sync, number it (the one sync counter: ``SyncStats.sync_index``), merge the ranks' stats,
    run ``sync.verify``."""

    def __init__(self, plan: SyncPlan, verify: Verify | None) -> None:
        self.plan = plan
        self.verify = verify
        self.syncs = 0
        self.last_verify: dict | None = None

    def _close(self, stats: SyncStats, policy: Any, sent: dict | None) -> SyncReport:
        stats.sync_index = self.syncs
        self.syncs += 1
        report = merge_over_ranks(stats)
        if self.verify is not None:  # raises SyncVerificationError on every rank on failure
            self.last_verify = self.verify(policy, sent)
        return report


class DirectSender(_SenderBase):
    """The resharding bridge: this rank's half of the plan's transport, into ``sink``
    (``LocalEngine`` or ``RemoteEngines``): the sink's ``begin`` gives the ``deliver``
    callable that takes each complete shard (None when this rank only sends)."""

    def __init__(
        self, transport: Transport, sink: LocalEngine | RemoteEngines, verify: Verify | None = None
    ) -> None:
        super().__init__(transport.plan, verify)
        self.transport = transport
        self.sink = sink

    def push(self, policy: Any) -> SyncReport:
        shards = dict(policy.named_shards())
        sent: dict[str, Checksum] | None = {} if self.verify is not None else None
        # Repacked parameters' checksums cost a pass over every weight: only when verifying.
        deliver = self.sink.begin(record_checksums=sent is not None)
        if deliver is not None and sent is not None:
            deliver = _recording(deliver, sent)
        with torch.no_grad(), device_mode_suspended():
            stats, _ = self.transport.run_plan(shards, deliver=deliver, finish=self.sink.finish)
        self.sink.done(stats)
        return self._close(stats, policy, sent)


def _recording(deliver: Deliver, sent: dict[str, Checksum]) -> Deliver:
    """``deliver`` that first records the checksum of every tensor it takes, by vLLM name."""

    def recorded(name: str, t: torch.Tensor) -> None:
        sent[name] = checksum(t)
        deliver(name, t)

    return recorded


class BaselineSender(_SenderBase):
    """The anchors' gather-and-broadcast into this rank's colocated engine."""

    def __init__(
        self,
        plan: SyncPlan,
        spec: ModelSpec,
        ctx: Any,
        engine: Any,
        padded_vocab: int | None,
        verify: Verify | None = None,
    ) -> None:
        super().__init__(plan, verify)
        self.spec, self.ctx, self.engine, self.padded_vocab = spec, ctx, engine, padded_vocab
        self._baselines: dict[int, BaselineSync] = {}
        """One per policy object synced (the trainer's, a served snapshot's)."""

    def push(self, policy: Any) -> SyncReport:
        base = self._baselines.get(id(policy))
        if base is None:
            base = BaselineSync(
                policy.models, self.spec, self.ctx, self.engine, padded_vocab=self.padded_vocab
            )
            self._baselines[id(policy)] = base
        with torch.no_grad():
            stats = base.gather_and_broadcast()
        stats.minimal_bytes = self.plan.minimal_bytes
        return self._close(stats, policy, None)


def colocated_sender(
    inputs: PlanInputs, spec: ModelSpec, ctx: Any, engine: Any, sync: SyncConfig
) -> WeightSender:
    """This rank's sender into its colocated ``engine`` (``PlanInputs.of`` this rank, with
    ``engines`` from ``distributed.placement``), by ``sync.method``, checked when
    ``sync.verify``."""

    def verify(policy: Any, sent: dict[str, Checksum] | None) -> dict:
        return verify_sync(ctx, policy, engine, sent)

    check = verify if sync.verify else None
    if sync.method == "baseline":
        plan = inputs.build(spec)
        return BaselineSender(plan, spec, ctx, engine, inputs.layout.padded_vocab, check)
    transport = inputs.transport(ctx.rank, None, ctx.device, spec)
    return DirectSender(transport, LocalEngine(engine), check)


def remote_sender(
    inputs: PlanInputs,
    ctx: Any,
    group: Any,
    begin: Callable[[], None] | None,
    end: Callable[[], float | None] | None,
) -> WeightSender:
    """A trainer rank's sender into disaggregated engines over the transfer ``group``
    (``begin``/``end``: see ``RemoteEngines``). Always the direct bridge, unverified:
    ``sync.method`` and ``sync.verify`` apply to colocated engines only."""
    return DirectSender(inputs.transport(ctx.rank, group, ctx.device), RemoteEngines(begin, end))


def merge_over_ranks(stats: SyncStats) -> SyncReport:
    """Gather every rank's ``SyncStats`` and merge them (a collective)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, stats)
    else:
        everyone = [stats]
    return SyncReport.merge(everyone)
