"""The trainer's policy: megatron-core model chunks, per-token log-probs, and one train step.

The batch and loss contracts (right-padded rows, position-aligned log-probs, the
temperature, and why megatron's own gradient rescaling is undone here) are in
docs/architecture-policy.md, "The policy's contracts". Micro-batches (``policy.micro_batches``):
``micro_batch_size`` padded rows, or rows packed end to end under a token budget;
``loss_fn`` sees padded [n, L] rows either way.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from megatron_grpo.algorithms.step_batch import Metrics, Rows, ScoreFn
from megatron_grpo.config.schema import ConfigError, ModelConfig, OptimConfig
from megatron_grpo.distributed.setup import ParallelContext
from megatron_grpo.models.spec import ModelSpec
from megatron_grpo.policy.checkpoint_state import load_sharded_state, sharded_state
from megatron_grpo.policy.forward import MicroBatchForward
from megatron_grpo.policy.lr_schedule import LRSchedule
from megatron_grpo.policy.model_builder import build_model, padded_vocab_size
from megatron_grpo.policy.optimizer import (
    TrainingParts,
    clip_gradients,
    finalize_grads_without_token_scaling,
    setup_training,
)
from megatron_grpo.policy.routing_replay import RoutingReplay
from megatron_grpo.policy.scoring import Scoring

R = TypeVar("R", bound=Rows)


class Policy:
    """Model chunks + ParallelContext (+ DDP, optimizer and LR schedule when trainable).

    Build with :func:`build_policy`. ``compute_logprobs`` and ``train_step`` are collective:
    every rank of the job calls them with its DP replica's batch.
    """

    def __init__(
        self,
        models: list[Any],
        ctx: ParallelContext,
        spec: ModelSpec,
        model_cfg: ModelConfig,
        optim_cfg: OptimConfig | None = None,
        *,
        total_steps: int = 1,
        temperature: float = 1.0,
        routing_replay: bool = False,
    ) -> None:
        if temperature <= 0:
            raise ValueError(
                f"policy temperature={temperature} must be > 0: it divides the logits "
                "(rollout.temperature; greedy T=0 is not a distribution to score)."
            )
        self.temperature = float(temperature)

        self.ctx, self.spec, self.model_cfg, self.optim_cfg = ctx, spec, model_cfg, optim_cfg
        self.models = list(models)  # unwrapped GPTModel per virtual stage
        self.config = self.models[0].config
        # docs/architecture-policy.md, "Loss contract": no division by num_microbatches, plain DP sum.
        self.config.calculate_per_token_loss = True
        self.config.finalize_model_grads_func = finalize_grads_without_token_scaling
        self.vocab_size = spec.vocab_size
        self.vocab_per_rank = padded_vocab_size(spec, ctx, model_cfg) // ctx.tp
        # hidden states -> logp, entropy on the last stage (model.logprob_impl; policy.scoring)
        self.scoring = Scoring(
            model_cfg.logprob_impl,
            vocab_start=ctx.tp_rank * self.vocab_per_rank,
            vocab_size=self.vocab_size,
            tp_group=ctx.tp_group,
        )
        self.trainable = optim_cfg is not None
        # MoE routers' hook for vLLM's experts (a batch's routed_experts): replayed, or only
        # compared with the router's own choice (policy.routing_replay; None when dense)
        self.routing_replay = routing_replay
        self.routing = RoutingReplay.install(self.models, ctx, replay=routing_replay)
        # micro-batches through megatron's schedule (policy.forward)
        self.forward = MicroBatchForward(self.models, ctx, model_cfg, self.scoring, self.routing)
        self.nan_steps_in_row = 0
        # DDP, optimizer and LR schedule (policy.optimizer); None when forward-only
        self.training = self._setup_training(total_steps)

    def _setup_training(self, total_steps: int) -> TrainingParts | None:
        """Wrap the chunks for training when trainable; otherwise freeze them for eval."""
        if self.trainable and self.ctx.vpp:
            # Seen with megatron-core 0.16.1 on gloo (pp=2, vpp=2): the forward-only
            # interleaved schedule works, but the training one deadlocks with
            # variable_seq_lengths=True (one stage waits in p2p_communication.py
            # _communicate_shapes while the other is in send_forward_recv_forward).
            raise ConfigError(
                f"parallel.vpp={self.ctx.vpp} is not supported for training yet: megatron's "
                "interleaved schedule deadlocks with per-micro-batch sequence lengths; set "
                "parallel.vpp=null (forward-only policies accept vpp)."
            )
        if self.optim_cfg is not None:
            return setup_training(self.models, self.ctx, self.optim_cfg, total_steps)
        for m in self.models:
            m.eval()
            m.requires_grad_(False)
        return None

    @property
    def chunks(self) -> list[Any]:
        """What megatron's schedule runs: the DDP-wrapped chunks, or the bare models."""
        return self.training.chunks if self.training else self.models

    @property
    def optimizer(self) -> Any:
        return self.training.optimizer if self.training else None

    @property
    def scheduler(self) -> LRSchedule | None:
        return self.training.scheduler if self.training else None

    @property
    def distributed_optimizer(self) -> bool:
        return bool(self.training and self.training.distributed_optimizer)

    # --------------------------------------------------------------------------- public
    @contextlib.contextmanager
    def at_temperature(self, temperature: float) -> Iterator[Policy]:
        """Score at ``temperature`` inside the block (e.g. T=1 to compare with vLLM's prompt
        log-probs, which are raw T=1 values; bridge/verify.py)."""
        saved, self.temperature = self.temperature, float(temperature)
        try:
            yield self
        finally:
            self.temperature = saved

    @torch.no_grad()
    def compute_logprobs(
        self, batch: Rows, micro_batch_size: int, *, token_budget: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Per-token ``logp`` and ``entropy`` [B, L] (fp32, on CPU), on every rank.

        Forward-only through megatron's pipeline schedule, ``micro_batch_size`` padded
        sequences per micro-batch, or with ``token_budget`` packed micro-batches of at most
        that many real tokens (``micro_batch_size`` is then not used); the last pipeline
        stage computes them and broadcasts to the others.
        """
        # the pass reads only the tokens (and the mask that gives each row's length), and
        # vLLM's experts of each token where the batch carries them
        batch = Rows(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                     routed_experts=batch.routed_experts)  # fmt: skip
        mbs = self.forward.split(batch, micro_batch_size, token_budget)
        ids = batch.input_ids
        for m in self.models:
            m.eval()

        def keep(logp: torch.Tensor, ent: torch.Tensor, mb: Rows) -> tuple[torch.Tensor, Metrics]:
            return logp.new_zeros(()), {"logp": logp, "entropy": ent}

        results = self.forward.run(
            self.chunks, mbs, keep, temperature=self.temperature, forward_only=True
        )
        out = torch.zeros(2, *ids.shape, dtype=torch.float32, device=self.ctx.device)
        if self.ctx.is_last_stage:
            for (rows, length, _, _), r in zip(mbs, results):
                out[0, rows, :length] = r["logp"][:, :length].float()
                out[1, rows, :length] = r["entropy"][:, :length].float()
        self.forward.broadcast_from_last_stage(out)
        out = out.cpu()
        if batch.attention_mask is not None:
            out *= batch.attention_mask.to(out.dtype)
        return {"logp": out[0], "entropy": out[1]}

    def train_step(
        self,
        batch: R,
        loss_fn: ScoreFn[R],
        micro_batch_size: int,
        *,
        token_budget: int | None = None,
    ) -> dict[str, Any]:
        """One optimizer step on ``batch``; returns metrics (same on every rank).

        Micro-batches as in ``compute_logprobs``: ``micro_batch_size`` padded rows, or
        packed under ``token_budget`` tokens. ``loss_fn`` sees padded rows either way.

        Metrics: ``loss`` (sum of loss_fn's losses over micro-batches and DP ranks, i.e. the
        global objective), ``grad_norm`` (before clipping), ``lr``, ``skipped`` (True when
        the loss or the grad norm was not finite: no update was applied), and loss_fn's own
        metrics averaged over micro-batches and DP ranks.
        """
        training, optim_cfg = self._trained()
        mbs = self.forward.split(batch, micro_batch_size, token_budget)
        for m in self.chunks:
            m.train()
            m.zero_grad_buffer()
        training.optimizer.zero_grad()

        def loss_of(logp: torch.Tensor, ent: torch.Tensor, mb: R) -> tuple[torch.Tensor, Metrics]:
            loss, metrics = loss_fn(logp, ent, mb)
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar loss, got {tuple(loss.shape)}")
            reduced = {"loss": loss.detach().float()}
            reduced.update({k: torch.as_tensor(v).detach().float() for k, v in metrics.items()})
            return loss, reduced

        results = self.forward.run(
            self.chunks, mbs, loss_of, temperature=self.temperature, forward_only=False
        )
        stats = self._reduce_metrics(results, len(mbs))

        training.optimizer.prepare_grads()
        grad_norm = float(training.optimizer.get_grad_norm())
        lr = training.scheduler.current_lr
        skipped = self._step_or_skip(stats["loss"], grad_norm, training, optim_cfg)
        return {**stats, "grad_norm": grad_norm, "lr": lr, "skipped": skipped}

    def _trained(self) -> tuple[TrainingParts, OptimConfig]:
        """What a train step steps with; a one-line error on a forward-only policy."""
        if self.training is None or self.optim_cfg is None:
            raise RuntimeError(
                "train_step on a forward-only Policy (built without optim_cfg): build it "
                "with build_policy(..., optim_cfg=...)."
            )
        return self.training, self.optim_cfg

    def _step_or_skip(
        self, loss: float, grad_norm: float, training: TrainingParts, optim_cfg: OptimConfig
    ) -> bool:
        """Clip and apply the gradients when ``loss`` and ``grad_norm`` are finite; otherwise
        drop them (no update) and raise after more than ``optim.max_nan_steps_in_row`` such
        steps in a row. Returns whether the step was skipped."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.nan_steps_in_row = 0
            clip_gradients(training.optimizer, optim_cfg.clip_grad, grad_norm)
            training.optimizer.step_with_ready_grads()
            training.scheduler.step()
            return False
        self.nan_steps_in_row += 1
        if self.nan_steps_in_row > optim_cfg.max_nan_steps_in_row:
            raise RuntimeError(
                f"{self.nan_steps_in_row} optimizer steps in a row had a non-finite loss "
                f"({loss}) or grad norm ({grad_norm}), more than "
                f"optim.max_nan_steps_in_row={optim_cfg.max_nan_steps_in_row}: lower "
                "optim.lr, check the loss inputs (advantages, pi_k_logp), or raise the limit."
            )
        training.optimizer.zero_grad()
        return True

    def _reduce_metrics(self, results: list[Any], num_mb: int) -> dict[str, float]:
        """Sum the loss / average the metrics over micro-batches and DP; share over PP."""
        stats: dict[str, float] | None = None
        if self.ctx.is_last_stage:
            keys = list(results[0].keys())
            vals = torch.stack(
                [torch.stack([r[k].reshape(()) for r in results]).sum() for k in keys]
            ).double()
            vals[1:] /= num_mb
            if self.ctx.dp > 1:
                dist.all_reduce(vals, group=self.ctx.dp_group)
                vals[1:] /= self.ctx.dp
            stats = dict(zip(keys, vals.tolist()))
        if self.ctx.pp > 1:
            box = [stats]
            dist.broadcast_object_list(box, src=self.ctx.last_stage_rank, group=self.ctx.pp_group)
            stats = box[0]
        assert stats is not None  # the last stage's, on every stage
        return stats

    # ------------------------------------------------------------- weights and checkpoints
    def named_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of this rank's LOCAL megatron parameter shards.

        Names are megatron's (``decoder.layers.<local i>.self_attention.linear_qkv.weight``)
        with the local layer index; ``chunk{c}.`` is prefixed only when vpp > 1. Tensors are
        the live parameters (DDP keeps them as views into its buffer): do not resize them.
        """
        for c, model in enumerate(self.models):
            prefix = f"chunk{c}." if self.ctx.vpp and self.ctx.vpp > 1 else ""
            for name, p in model.named_parameters():
                yield prefix + name, p

    def sharded_state_dict(self, for_loading: bool = False) -> dict[str, Any]:
        """megatron dist_checkpointing state: ``model`` (``model0``, ``model1``... with vpp),
        and when trainable ``optimizer`` and ``lr_schedule``; ``for_loading=True`` builds the
        template to load into (``policy.checkpoint_state.sharded_state``)."""
        return sharded_state(self.models, self.training, for_loading)

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Apply a state loaded by ``dist_checkpointing.load(self.sharded_state_dict(), ...)``."""
        load_sharded_state(self.models, self.training, state)

    @torch.no_grad()
    def copy_weights_from(self, other: Policy) -> None:
        """Copy ``other``'s local shards into this policy (same spec and layout); a trainable
        policy's optimizer main params follow (its moments are kept as they are)."""
        mine = dict(self.named_shards())
        theirs = dict(other.named_shards())
        if mine.keys() != theirs.keys():
            diff = sorted(set(mine) ^ set(theirs))[:4]
            raise ValueError(f"policies have different parameters (e.g. {diff})")
        for name, p in mine.items():
            p.copy_(theirs[name])
        if self.trainable:
            # In bf16/fp16 (and with the distributed optimizer) the optimizer steps fp32 main
            # params, not these: without this the next step would continue from the old
            # weights (megatron/core/optimizer/optimizer.py ``reload_model_params``).
            self.optimizer.reload_model_params()

    def make_reference(self) -> Policy:
        """A forward-only copy of this policy's current weights (pi_ref). Reset it later with
        ``ref.copy_weights_from(policy)``."""
        ref = build_policy(self.spec, self.ctx, self.model_cfg, None, temperature=self.temperature,
                           routing_replay=self.routing_replay)  # fmt: skip
        ref.copy_weights_from(self)
        return ref


def build_policy(
    spec: ModelSpec,
    ctx: ParallelContext,
    model_cfg: ModelConfig,
    optim_cfg: OptimConfig | None = None,
    *,
    init_weights: Callable[[list[Any]], None] | None = None,
    total_steps: int = 1,
    temperature: float = 1.0,
    routing_replay: bool = False,
) -> Policy:
    """Build the model chunks, fill them with ``init_weights(chunks)`` (e.g.
    ``partial(load_hf_into_megatron, hf_dir=..., spec=spec, ctx=ctx)``) BEFORE the optimizer
    copies them, and wrap them for training when ``optim_cfg`` is given (forward-only
    otherwise). ``total_steps`` sets the length of the cosine schedule; ``temperature`` the T
    its log-probs are computed at (logits / T; ``rollout.temperature`` in training);
    ``routing_replay`` routes MoE tokens to the batch's ``routed_experts`` (vLLM's)."""
    models = build_model(spec, ctx, model_cfg)
    if init_weights is not None:
        init_weights(models)
    return Policy(models, ctx, spec, model_cfg, optim_cfg, total_steps=total_steps,
                  temperature=temperature, routing_replay=routing_replay)  # fmt: skip


__all__ = ["LRSchedule", "Policy", "build_policy"]
