"""The trainer's handle on the resharding bridge: push the policy's shards into vLLM.

Colocated placement: every trainer rank hosts one vLLM TP rank in-process
(``external_launcher``), so engine ``e`` is global ranks ``[e*t, (e+1)*t)`` for rollout TP
``t``. The plan is built once from the layouts (``bridge.plan.build_plan``); each sync runs
the transport with the local vLLM receiver as its sink, inside vLLM's reload protocol
(start -> per-shard update -> finish, ``bridge.receiver``), so CPU repacking and quantized
layers are redone exactly as after a checkpoint load.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from megatron_grpo.bridge.accounting import SyncReport, SyncStats
from megatron_grpo.bridge.plan import TrainerPlacement, build_plan
from megatron_grpo.bridge.transport import Transport
from megatron_grpo.config.schema import SyncConfig
from megatron_grpo.distributed.setup import ParallelContext
from megatron_grpo.models.spec import ModelSpec
from megatron_grpo.platform.cpu import device_mode_suspended


def colocated_engine_ranks(world_size: int, rollout_tp: int) -> list[list[int]]:
    """Global ranks of each colocated engine's TP ranks (vLLM's external_launcher layout)."""
    if world_size % rollout_tp:
        raise ValueError(
            f"rollout.tp={rollout_tp} does not divide the world size {world_size}: colocated "
            "engines take consecutive groups of rollout.tp ranks. Pick a divisor."
        )
    return [
        list(range(e * rollout_tp, (e + 1) * rollout_tp)) for e in range(world_size // rollout_tp)
    ]


def norm_style(names: list[str]) -> str:
    """``te`` when the layer norms are fused into Transformer-Engine linears, else ``local``."""
    return "te" if any(n.endswith("layer_norm_weight") for n in names) else "local"


class WeightSync:
    """Builds the static plan and transport once; ``sync(policy)`` pushes its weights.

    ``sync.method=direct`` runs the resharding bridge; ``baseline`` runs what the anchors do
    (``bridge.baseline``: gather full HF tensors on rank 0, broadcast, vLLM's own
    ``load_weights``), measured by the same accounting. The plan is built either way so
    ``minimal_bytes`` is known."""

    def __init__(
        self,
        spec: ModelSpec,
        ctx: ParallelContext,
        shards: Mapping[str, torch.Tensor],
        engine,
        sync_cfg: SyncConfig,
        rollout_tp: int,
        padded_vocab: int,
    ) -> None:
        self.engine = engine
        self.ctx = ctx
        dtype = next(iter(shards.values())).dtype
        placement = TrainerPlacement(
            tp=ctx.tp,
            pp=ctx.pp,
            vpp=ctx.vpp or 1,
            dp=ctx.dp,
            norm_style=norm_style(list(shards)),
            padded_vocab=padded_vocab,
        )
        element_size = torch.empty((), dtype=dtype).element_size()
        engines = colocated_engine_ranks(ctx.world_size, rollout_tp)
        self.plan = build_plan(spec, placement, rollout_tp, engines, element_size=element_size)
        self.transport = Transport(
            self.plan,
            ctx.rank,
            bucket_mb=sync_cfg.bucket_mb,
            timeout_s=sync_cfg.timeout_s,
            dtype=dtype,
            device=ctx.device,
        )
        self.minimal_bytes = self.plan.minimal_bytes
        self.method = sync_cfg.method
        self.padded_vocab = padded_vocab
        self.spec = spec
        self._baselines: dict[int, object] = {}
        self.syncs = 0
        self.verify = sync_cfg.verify
        self.last_verify: dict | None = None
        """``sync.verify``: the checks of the latest sync (``bridge.verify.verify_sync``)."""

    def sync(self, policy) -> SyncReport:
        """Push ``policy``'s weights into every colocated vLLM rank.

        Collective over the job: every rank calls it. Returns the merged report of all ranks
        (bytes summed over senders, phase times of the slowest rank).
        """
        sent: dict | None = None
        if self.method == "baseline":
            report = self._sync_baseline(policy)
        else:
            sent = {} if self.verify else None
            report = self.sync_shards(dict(policy.named_shards()), sent_checksums=sent)
        if self.verify:  # raises SyncVerificationError on every rank when a check fails
            from megatron_grpo.bridge.verify import verify_sync

            self.last_verify = verify_sync(self.ctx, policy, self.engine, sent)
        return report

    def _sync_baseline(self, policy) -> SyncReport:
        from megatron_grpo.bridge.baseline import BaselineSync

        base = self._baselines.get(id(policy))
        if base is None:
            base = BaselineSync(
                policy.models, self.spec, self.ctx, self.engine, padded_vocab=self.padded_vocab
            )
            self._baselines[id(policy)] = base
        with torch.no_grad():
            stats = base.sync()
        stats.minimal_bytes = self.minimal_bytes
        self.syncs += 1
        return merge_over_ranks(stats)

    def sync_shards(
        self, shards: Mapping[str, torch.Tensor], sent_checksums: dict | None = None
    ) -> SyncReport:
        """The direct bridge: push ``shards`` (this rank's trainer shards by name). With
        ``sent_checksums`` (a dict), the checksum of every tensor delivered to this rank's
        vLLM receiver is recorded in it, by vLLM name."""
        # Repacked parameters' checksums cost a pass over every weight: only when verifying.
        receiver = self.engine.begin_weight_update(record_checksums=sent_checksums is not None)
        sink = receiver.receive_shard
        if sent_checksums is not None:
            from megatron_grpo.bridge.verify import checksum

            def sink(name: str, t: torch.Tensor) -> None:
                sent_checksums[name] = checksum(t)
                receiver.receive_shard(name, t)

        with torch.no_grad(), device_mode_suspended():
            stats, _ = self.transport.sync(
                shards, sink=sink, finish=self.engine.finish_weight_update
            )
        self.engine.update_phases(stats)
        self.syncs += 1
        return merge_over_ranks(stats)


def merge_over_ranks(stats: SyncStats) -> SyncReport:
    """Gather every rank's ``SyncStats`` and merge them (a collective)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, stats)
    else:
        everyone = [stats]
    return SyncReport.merge(everyone)
