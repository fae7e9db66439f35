"""A batch's micro-batches through megatron's pipeline schedule: cut (``policy.micro_batches``),
moved to the device in one copy, run through the model (padded rows, or a pack with its
RoPE), and the last stage's output scored (``policy.scoring``) and handed to a ``score``
function. ``Policy.compute_logprobs`` and ``Policy.train_step`` differ only in that function.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from megatron_grpo.algorithms.step_batch import Metrics, Rows, ScoreFn
from megatron_grpo.config.schema import ConfigError, ModelConfig, context_parallel_gap
from megatron_grpo.distributed.setup import ParallelContext
from megatron_grpo.policy.context_parallel import ContextShard
from megatron_grpo.policy.kernels import resolve_transformer_impl
from megatron_grpo.policy.micro_batches import (
    MicroBatches,
    PackedRows,
    agreed_count,
    empty_micro_batch,
    split_batch,
)
from megatron_grpo.policy.rope import PackedRope
from megatron_grpo.policy.routing_replay import RoutingReplay
from megatron_grpo.policy.scoring import Scoring
from megatron_grpo.policy.transfer import to_device

R = TypeVar("R", bound=Rows)


class MicroBatchForward:
    """The forward plumbing of one ``Policy``: its model chunks' micro-batch forward."""

    def __init__(
        self,
        models: list[Any],
        ctx: ParallelContext,
        model_cfg: ModelConfig,
        scoring: Scoring,
        routing: RoutingReplay | None,
    ) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.ctx, self.scoring, self.routing = ctx, scoring, routing
        self.config = models[0].config
        self._forward_backward = get_forward_backward_func()
        # Sequence parallelism splits every micro-batch's sequence dim over the TP ranks.
        self._length_multiple = ctx.tp if ctx.sequence_parallel else 1
        # megatron's unfused DotProductAttention refuses packed sequences; SDPA and TE take them
        self.can_pack = (
            resolve_transformer_impl(model_cfg, ctx.device) == "transformer_engine"
            or model_cfg.local_attention == "sdpa"
        )
        # RoPE of packed micro-batches, applied by the core attention (policy.rope) where the
        # model builder made the model leave it to it
        self.packed_rope = (
            PackedRope(models[0], ctx.device)
            if getattr(models[0].rotary_pos_emb, "packed_by_core_attention", False)
            else None
        )
        if ctx.cp > 1:
            refuse_context_parallel(ctx, model_cfg, self.packed_rope is not None)

    def split(self, batch: R, micro_batch_size: int, token_budget: int | None) -> MicroBatches[R]:
        if self.ctx.cp > 1 and token_budget is None:
            # context parallelism splits packs: padded rows (sync.verify, eval, a caller
            # without a budget) are packed instead, micro_batch_size full-width rows' worth
            # at a time; the log-probs are the padded ones (tests/policy/test_packing.py)
            token_budget = micro_batch_size * batch.input_ids.shape[1]
        return split_batch(
            batch, micro_batch_size, token_budget, self._length_multiple, can_pack=self.can_pack,
            cp=self.ctx.cp, cp_rank=self.ctx.cp_rank,
        )  # fmt: skip

    def run(
        self, chunks: list[Any], mbs: MicroBatches[R], score: ScoreFn[R], *, temperature: float,
        forward_only: bool,
    ) -> list[Any]:  # fmt: skip
        """megatron's schedule over ``chunks`` (DDP-wrapped or bare) and the micro-batches
        ``mbs`` of ``split``; each micro-batch's output is scored at ``temperature`` and
        reduced by ``score`` (``_step``). Returns the last stage's reduced values."""
        # expert-parallel ranks run one count: the most any of them has, the others adding
        # empty micro-batches (policy.micro_batches.agreed_count); the pipeline stages of a
        # replica split the same batch, so they agree with it
        num_mb = agreed_count(len(mbs), self.ctx.ep_group, self.ctx.ep)
        if self.ctx.vpp and num_mb % self.ctx.pp:
            raise ValueError(
                f"{num_mb} micro-batches with parallel.vpp={self.ctx.vpp}: megatron's "
                f"interleaved schedule needs a multiple of pp({self.ctx.pp}); change "
                "micro_batch_size or the batch size."
            )
        items: list[tuple[Rows, PackedRows | None, bool]] = [
            (mb, pack, True) for _, _, mb, pack in mbs
        ]
        if num_mb > len(mbs):
            empty, empty_pack = empty_micro_batch(
                mbs[0][2], mbs[0][3], self._length_multiple, self.ctx.cp, self.ctx.cp_rank
            )
            items += [(empty, empty_pack, False)] * (num_mb - len(mbs))
        shapes = [(mb.input_ids if pack is None else pack.input_ids).shape for mb, pack, _ in items]
        iters: list[Iterator[Any]] = [iter(items) for _ in chunks]
        results: list[Any] = self._forward_backward(
            forward_step_func=self._step(score, temperature),
            data_iterator=iters if len(iters) > 1 else iters[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=num_mb,
            seq_length=max(shape[1] for shape in shapes),
            micro_batch_size=max(shape[0] for shape in shapes),
            forward_only=forward_only,
        )
        # the empty micro-batches come last and reduce to nothing the callers read
        return results[: len(mbs)]

    def _step(self, score: ScoreFn[R], temperature: float) -> Callable[..., Any]:
        """megatron's ``forward_step_func`` for one micro-batch: its tensors moved to the
        device in one copy, the model's output (logits or hidden states, ``self.scoring``),
        and a reduction that scores it (``logp``, ``entropy`` [n, L] of the padded rows) and
        hands them with the micro-batch's tensors to ``score(logp, entropy, mb) -> (loss,
        reduced)``."""

        def step(
            data_iterator: Iterator[tuple[Any, PackedRows | None, bool]], model: Any
        ) -> tuple[torch.Tensor, Any]:
            mb, pack, real = next(data_iterator)
            mb, pack = self._to_device(mb, pack)
            if self.routing is not None:  # this micro-batch's vLLM experts, on every stage
                routed = mb.routed_experts if pack is None else pack.routed_experts
                if routed is not None and pack is not None and pack.cp_local is not None:
                    # context parallelism: the experts of this CP rank's tokens, in their
                    # zigzag order (the model runs on those only, ``_model_forward``)
                    routed = routed[pack.cp_local]
                self.routing.set_targets(routed, packed=pack is not None)
            out = self._model_forward(model, mb, pack)

            def reduce(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
                one = torch.ones((), dtype=torch.int, device=self.ctx.device)
                if not real:  # an empty micro-batch: a zero loss whose backward still runs
                    # the MoE layers' alltoalls (and scoring's TP collectives) as a real one's
                    ids = mb.input_ids if pack is None else pack.input_ids
                    shard = None if pack is None else self._shard(pack)  # CP: its share
                    logp, _ = self.scoring.token_logprobs(out, ids, temperature, shard=shard)
                    return logp.sum() * 0.0, one, {}
                logp, ent = self._row_logp_entropy(out, mb, pack, temperature)
                loss, reduced = score(logp, ent, mb)
                # num_tokens is unused (calculate_per_token_loss, docs/architecture-policy.md)
                return loss, one, reduced

            return out, reduce

        return step

    def _to_device(self, mb: R, pack: PackedRows | None) -> tuple[R, PackedRows | None]:
        """The micro-batch's and the pack's tensors on the device, in one copy
        (``policy.transfer``); other values as they are."""
        tensors = {f"mb.{k}": v for k, v in mb.tensors().items()}
        if pack is not None:
            tensors.update({f"pack.{k}": v for k, v in pack.tensors().items()})
        moved = to_device(tensors, self.ctx.device)
        mb = mb.with_tensors({k[3:]: v for k, v in moved.items() if k.startswith("mb.")})
        if pack is not None:
            pack = pack.on(
                {k: t for k in pack.TENSORS if (t := moved.get(f"pack.{k}")) is not None}
            )
        return mb, pack

    def _model_forward(self, model: Any, mb: Rows, pack: PackedRows | None) -> torch.Tensor:
        """The last stage's output (``self.scoring``: logits [n, L, V/tp] or hidden states) of
        the padded rows, or of the pack ([1, T, ...]); tensors on the device."""
        if pack is not None:
            # RoPE of a pack: cos/sin of each token's position in its document, once per
            # micro-batch, applied by the core attention (policy.rope); without it (TE's
            # attention) megatron applies RoPE per document from cu_seqlens. position_ids
            # feed only learned absolute embeddings, which a RoPE model has none of.
            # Under context parallelism the model runs on this CP rank's tokens only
            # (policy.context_parallel: the zigzag share of every document), with their
            # positions; the core attention gathers the rest of each document's K/V.
            shard = self._shard(pack)
            ids, positions = pack.input_ids, pack.positions
            if shard is not None:
                ids, positions = ids[:, shard.local], positions[shard.local]
            rope = None
            if self.packed_rope is not None:
                rope = self.packed_rope.cos_sin(positions, self.config.params_dtype)
            params = pack.packed_seq_params(rope)
            params.cp = shard
            out: torch.Tensor = model(
                ids, positions.unsqueeze(0), None, packed_seq_params=params,
                **self.scoring.forward_kwargs,
            )  # fmt: skip
            return out
        ids = mb.input_ids
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        # attention_mask=None: the local/TE core attention applies its causal mask
        # (AttnMaskType.causal in the GPT layer spec).
        out = model(ids, positions, None, **self.scoring.forward_kwargs)
        return out

    def _row_logp_entropy(
        self, out: torch.Tensor, mb: Rows, pack: PackedRows | None, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``logp``, ``entropy`` [n, L] of the micro-batch's rows, position-aligned; the
        temperature divides each fp32 chunk inside: no divided copy of the logits."""
        ids = mb.input_ids
        if pack is None:
            return self.scoring.token_logprobs(out, ids, temperature)
        logp, ent = self.scoring.token_logprobs(
            out, pack.input_ids, temperature, shard=self._shard(pack)
        )
        shape = (ids.shape[0], ids.shape[1])
        return pack.unpack(logp, shape), pack.unpack(ent, shape)

    def _shard(self, pack: PackedRows) -> ContextShard | None:
        """This CP rank's share of ``pack`` (tensors on the device), or None without CP."""
        if pack.cp_local is None or pack.cp_stacked is None or pack.cp_order is None:
            return None
        return ContextShard(
            self.ctx.cp, self.ctx.cp_group, pack.cp_chunks, pack.cp_local, pack.cp_stacked,
            pack.cp_order,
        )  # fmt: skip

    def broadcast_from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        if self.ctx.pp > 1:
            dist.broadcast(t, src=self.ctx.last_stage_rank, group=self.ctx.pp_group)
        return t


def refuse_context_parallel(
    ctx: ParallelContext, model_cfg: ModelConfig, packed_rope: bool
) -> None:
    """One ConfigError line for a layout the context-parallel path does not run yet
    (``parallel.cp`` > 1; docs/context-parallel.md, "What it does not do yet"); the config
    refuses the same before any work (``config.schema``), this guards policies built
    directly."""
    impl = resolve_transformer_impl(model_cfg, ctx.device)
    why = context_parallel_gap(impl, model_cfg.local_attention, packed_rope, ctx.vpp)
    if why is not None:
        raise ConfigError(f"parallel.cp={ctx.cp} does not run with {why} or parallel.cp=1.")
