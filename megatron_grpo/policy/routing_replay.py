"""Routing replay: megatron's MoE routers route each token to the experts vLLM chose for it.

megatron-core 0.19's ``topk_routing_with_score_function`` (transformer/moe/moe_utils.py)
takes its top-k from ``router.router_replay.get_replay_topk(scores, topk, ...)`` when the
router has one (``TopKRouter.routing``). megatron's own ``RouterReplay`` is one process-wide
list of routers switched by global actions (transformer/moe/router_replay.py), which a
process holding several models (policy, reference, alpha) cannot share; ``RoutingSlot`` is
the same hook, installed on each router of one model when it is built (``install``). Given
the micro-batch's target experts it returns them with the router's own scores gathered
there: softmax over the chosen logits (HF's ``norm_topk_prob``) or the full softmax's values
(``pre_softmax``), exactly as megatron's replay does. The load-balancing loss is unchanged: it
recomputes its own top-k from the logits (``compute_routing_scores_for_aux_loss``). Tokens
without a target (-1: a row's last token, padding) keep the router's choice.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_grpo.config.schema import ConfigError
from megatron_grpo.distributed.setup import ParallelContext


class RoutingSlot:
    """One router's replay hook: the micro-batch's target experts and the mismatch counts."""

    def __init__(self, layer: int, replay: bool) -> None:
        self.layer, self.replay = layer, replay
        self.layer_number: int | None = None  # megatron's set_layer_number writes it
        self.target: torch.Tensor | None = None
        """long [tokens, top-k] in the router's token order (sequence-major), -1 rows: none."""
        self.counts = torch.zeros(2, dtype=torch.long)
        """(routings whose top-k set differs from the target, routings compared)."""

    def get_replay_topk(
        self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        assert default_compute_topk is not None, "megatron's top-k (moe_utils) is passed in"
        probs, own = default_compute_topk(
            scores, topk, num_groups=num_groups, group_topk=group_topk
        )
        if self.target is None:
            return probs, own
        target = self.target.to(scores.device, non_blocking=True)
        if target.shape != own.shape:
            raise RuntimeError(
                f"routing replay, layer {self.layer}: {tuple(target.shape)} target experts for "
                f"a router top-k of {tuple(own.shape)}: the micro-batch's routed_experts do "
                "not follow its tokens."
            )
        valid = target[:, 0] >= 0
        same = (own.sort(dim=1).values == target.sort(dim=1).values).all(dim=1)
        counts = torch.stack([(valid & ~same).sum(), valid.sum()])
        self.counts = self.counts.to(counts.device) + counts
        if not self.replay:
            return probs, own
        chosen = torch.where(valid.unsqueeze(1), target, own)
        return scores.gather(1, chosen), chosen


class RoutingReplay:
    """The slots of one model's routers; feeds each micro-batch's targets to them."""

    def __init__(self, slots: list[RoutingSlot], tp_rank: int, sp_size: int) -> None:
        self.slots, self.tp_rank, self.sp_size = slots, tp_rank, sp_size

    @classmethod
    def install(
        cls, models: list[torch.nn.Module], ctx: ParallelContext, replay: bool
    ) -> RoutingReplay | None:
        """A slot on every ``TopKRouter`` of ``models`` (None: a dense model)."""
        from megatron.core.transformer.moe import moe_utils
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for model in models for m in model.modules() if isinstance(m, TopKRouter)]
        if not routers:
            return None
        params = inspect.signature(moe_utils.topk_routing_with_score_function).parameters
        if "router_replay" not in params:
            raise ConfigError(
                "rollout.routing_replay needs megatron-core's router_replay hook (0.19): this "
                "megatron-core has none; set rollout.routing_replay=off or upgrade it."
            )
        slots = []
        for r in routers:
            slot = RoutingSlot(r.layer_number - 1, replay)  # layer_number: global, from 1
            slot.layer_number = r.layer_number
            r.router_replay = slot
            slots.append(slot)
        return cls(slots, ctx.tp_rank, ctx.tp if ctx.sequence_parallel else 1)

    def set_targets(self, routed: torch.Tensor | None, packed: bool) -> None:
        """The next forward's targets: ``routed`` int [n, L, layers, k] (padded rows) or
        [T, layers, k] (a pack), None for none. Tokens reach the router sequence-major
        ([L, n] flattened; a pack is [T, 1]), split over the TP ranks under sequence
        parallelism (megatron scatters the sequence dim)."""
        if routed is None:
            for s in self.slots:
                s.target = None
            return
        seq_major = routed if packed else routed.transpose(0, 1)
        if self.sp_size > 1:
            seq_major = seq_major.chunk(self.sp_size, dim=0)[self.tp_rank]
        flat = seq_major.reshape(-1, *routed.shape[-2:]).long()
        for s in self.slots:
            s.target = flat[:, s.layer]

    def take_mismatch(self) -> float | None:
        """The share of (token, MoE layer) routings since the last call where the router's
        own top-k set differed from the target, over the whole world (collective; TP ranks
        count the same tokens, which scales both sums alike); None when none was compared."""
        counts = sum((s.counts.cpu() for s in self.slots), torch.zeros(2, dtype=torch.long))
        for s in self.slots:
            s.counts = torch.zeros(2, dtype=torch.long)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        return float(counts[0]) / float(counts[1]) if counts[1] else None
