"""The trainer's handle on the resharding bridge: push the policy's shards into vLLM.

One face, ``WeightSender`` (``sync(policy) -> SyncReport``, ``syncs``, ``last_verify``,
``plan``), two implementations chosen once when built, by ``sync.method``:

- ``DirectSender``, the resharding bridge: the static plan (``bridge.plan.build_plan``, built
  once from the layouts) runs on the ``Transport``; placements differ only in the *sink*,
  where this rank's half of the sync lands:

  - colocated (``LocalEngine``): every trainer rank hosts one vLLM TP rank in-process
    (``external_launcher``), so engine ``e`` is global ranks ``[e*t, (e+1)*t)`` for rollout
    TP ``t``. Each completed shard goes to the local receiver inside vLLM's reload protocol
    (start -> per-shard update -> finish, ``bridge.receiver``), so CPU repacking and
    quantized layers are redone exactly as after a checkpoint load.
  - disaggregated (``RemoteEngines``): the first ``n_train`` torchrun ranks train, the last
    ``num_engines * rollout.tp`` ranks each stand for one TP rank of a vLLM engine whose
    workers are separate processes (``distributed.placement.place_ranks``). Trainer ranks only
    send; the sink is the engines' control messages (the rollout layer's, seen here as two
    callables) that open the update on the engines and report its end.

- ``BaselineSender``, what the anchors do (``bridge.baseline``: gather full HF tensors on
  rank 0, broadcast, vLLM's own ``load_weights``), measured by the same accounting;
  colocated only. The plan is built either way so ``minimal_bytes`` is known.

Disaggregated weights travel over a *transfer group* (``init_transfer_group``) spanning the
trainer ranks and the engine workers: group rank of trainer rank ``r`` = ``r``; group rank of
worker ``k`` of engine ``e`` = ``engines[e][k]`` (the global rank standing for it). Its ranks
are exactly the plan's ranks, so one ``SyncPlan`` and one ``Transport`` serve both sides: no
second wire format. Each worker *rebuilds* the plan from the same ``PlanInputs`` (sent at
init, ``vllm_plugin.TransferInitInfo.plan``) and runs the receiving half of the transport
(``worker_transport``); the build is deterministic, and the transport's fingerprint
handshake raises ``PlanMismatchError`` on the first sync if the two sides ever disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megatron_grpo.bridge.accounting import SyncReport, SyncStats
from megatron_grpo.bridge.baseline import BaselineSync
from megatron_grpo.bridge.checksum import Checksum, checksum
from megatron_grpo.bridge.plan import SyncPlan, build_plan
from megatron_grpo.bridge.transport import Sink, Transport
from megatron_grpo.bridge.verify import verify_sync
from megatron_grpo.config.schema import SyncConfig
from megatron_grpo.layouts.megatron import MegatronLayout
from megatron_grpo.models.spec import ModelSpec, load_spec
from megatron_grpo.platform.cpu import device_mode_suspended

Verify = Callable[[Any, dict | None], dict]
"""``(policy, checksums of what this rank's vLLM receiver was sent) -> figures``: the
``sync.verify`` checks (``bridge.verify.verify_sync``); raises when a check fails."""


# ---------------------------------------------------------------------------- plan inputs
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

    @classmethod
    def of(
        cls,
        model_dir: Any,
        ctx: Any,
        policy: Any,
        sync: SyncConfig,
        rollout_tp: int,
        engines: list[list[int]],
    ) -> PlanInputs:
        """This trainer rank's inputs: the layout of ``ctx`` (a ``ParallelContext``) with the
        norm naming, padded vocabulary and dtype of ``policy``'s shards."""
        shards = dict(policy.named_shards())
        dtype = next(iter(shards.values())).dtype
        return cls(
            model_dir=str(model_dir),
            layout=MegatronLayout.of(ctx, shards, policy.vocab_per_rank * ctx.tp),
            rollout_tp=rollout_tp, engines=engines, dtype=str(dtype).removeprefix("torch."),
            bucket_mb=sync.bucket_mb, timeout_s=sync.timeout_s,
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
            element_size,
        )  # fmt: skip

    def transport(
        self, rank: int, group, device: torch.device | str, spec: ModelSpec | None = None
    ) -> Transport:
        return Transport(
            self.build(spec), rank, group=group, bucket_mb=self.bucket_mb,
            timeout_s=self.timeout_s, dtype=self.torch_dtype, device=device,
        )  # fmt: skip


# ---------------------------------------------------------------------------- senders
class WeightSender(Protocol):
    """What the trainer holds to push its weights into the rollout engines."""

    plan: SyncPlan
    """The direct plan of this layout (``plan.minimal_bytes``: what a sync must deliver)."""
    syncs: int
    """Syncs run so far."""
    last_verify: dict | None
    """``sync.verify``: the figures of the latest sync's checks; None when not verifying."""

    def sync(self, policy: Any) -> SyncReport:
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

    def begin(self, record_checksums: bool) -> Sink:
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
    sync, count it, merge the ranks' stats, run ``sync.verify``."""

    def __init__(self, plan: SyncPlan, verify: Verify | None) -> None:
        self.plan = plan
        self.verify = verify
        self.syncs = 0
        self.last_verify: dict | None = None

    def _close(self, stats: SyncStats, policy: Any, sent: dict | None) -> SyncReport:
        self.syncs += 1
        report = merge_over_ranks(stats)
        if self.verify is not None:  # raises SyncVerificationError on every rank on failure
            self.last_verify = self.verify(policy, sent)
        return report


class DirectSender(_SenderBase):
    """The resharding bridge: this rank's half of the plan's transport, into ``sink``
    (``LocalEngine`` or ``RemoteEngines``)."""

    def __init__(
        self, transport: Transport, sink: LocalEngine | RemoteEngines, verify: Verify | None = None
    ) -> None:
        super().__init__(transport.plan, verify)
        self.transport = transport
        self.sink = sink

    def sync(self, policy: Any) -> SyncReport:
        shards = dict(policy.named_shards())
        sent: dict[str, Checksum] | None = {} if self.verify is not None else None
        # Repacked parameters' checksums cost a pass over every weight: only when verifying.
        receive = self.sink.begin(record_checksums=sent is not None)
        if receive is not None and sent is not None:
            receive = _recording(receive, sent)
        with torch.no_grad(), device_mode_suspended():
            stats, _ = self.transport.sync(shards, sink=receive, finish=self.sink.finish)
        self.sink.done(stats)
        return self._close(stats, policy, sent)


def _recording(receive: Sink, sent: dict[str, Checksum]) -> Sink:
    """``receive`` that first records the checksum of every tensor it takes, by vLLM name."""

    def sink(name: str, t: torch.Tensor) -> None:
        sent[name] = checksum(t)
        receive(name, t)

    return sink


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

    def sync(self, policy: Any) -> SyncReport:
        base = self._baselines.get(id(policy))
        if base is None:
            base = BaselineSync(
                policy.models, self.spec, self.ctx, self.engine, padded_vocab=self.padded_vocab
            )
            self._baselines[id(policy)] = base
        with torch.no_grad():
            stats = base.sync()
        stats.minimal_bytes = self.plan.minimal_bytes
        return self._close(stats, policy, None)


def colocated_sender(
    model_dir: Any,
    spec: ModelSpec,
    ctx: Any,
    policy: Any,
    engine: Any,
    sync: SyncConfig,
    engines: list[list[int]],
) -> WeightSender:
    """This rank's sender into its colocated ``engine`` (``sync.method``, ``sync.verify``);
    ``engines[e]``: the global ranks of engine ``e``'s TP ranks (``distributed.placement``)."""
    inputs = PlanInputs.of(model_dir, ctx, policy, sync, len(engines[0]), engines)

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


# ---------------------------------------------------------------------------- transfer group
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
    if backend == "gloo":
        pg: dist.ProcessGroup = dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
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
