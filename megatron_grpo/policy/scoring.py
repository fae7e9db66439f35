"""The one place the last stage's output becomes per-token log-probs and entropies, chosen once
by ``model.logprob_impl``: ``fused`` (GPTModel hands over its final hidden states and the
output weight; ``policy.fused_logprob``) or ``logits`` (the output layer's logits, then
``policy.logprob``). Design and figures: docs/scoring.md."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from megatron_grpo.config.schema import ConfigError
from megatron_grpo.policy.context_parallel import ContextShard
from megatron_grpo.policy.fused_logprob import fused_logprob_entropy, fused_peak_bytes
from megatron_grpo.policy.logprob import logprob_peak_bytes, vocab_parallel_logprob_entropy


class HiddenStates(NamedTuple):
    """What a fused last stage hands over instead of logits."""

    hidden: torch.Tensor
    """[b, s, h] final hidden states after the output layer's input region (a view)."""
    weight: torch.Tensor
    """[V/tp, h] this rank's output weight rows (the embedding weight when tied)."""

    @property
    def device(self) -> torch.device:
        return self.hidden.device


def gpt_model_hands_over_hidden() -> bool:
    """Whether the installed megatron-core's ``GPTModel.forward`` takes ``output_processor``
    (megatron/core/models/gpt/gpt_model.py ``_postprocess``: called with the final hidden
    states and the output layer in place of the output layer; 0.19.2 has it)."""
    from megatron.core.models.gpt import GPTModel

    return "output_processor" in inspect.signature(GPTModel.forward).parameters


def resolve_logprob_impl(impl: str) -> str:
    """``model.logprob_impl`` with ``auto`` resolved: ``fused`` where megatron-core can hand over
    the hidden states, else ``logits``; an explicit ``fused`` there is refused."""
    if impl == "auto":
        return "fused" if gpt_model_hands_over_hidden() else "logits"
    if impl == "fused" and not gpt_model_hands_over_hidden():
        import megatron.core

        raise ConfigError(
            f"model.logprob_impl=fused needs GPTModel.forward(output_processor=...), which "
            f"megatron-core {megatron.core.__version__} lacks: install megatron-core 0.19.2 or "
            "set model.logprob_impl=logits (or auto)."
        )
    return impl


def scoring_bytes(impl: str, tokens: int, local_vocab: int, hidden: int, elem: int) -> int:
    """Bytes the scoring of one micro-batch of ``tokens`` adds on the last stage (``plan``):
    ``logits``: the logits (kept for the recompute), their gradient and the output layer's
    transposed copy in the training dtype plus the chunks' fp32 temporaries; ``fused``
    (also ``auto``): ``fused_peak_bytes``."""
    if impl == "logits":
        return 3 * elem * tokens * local_vocab + logprob_peak_bytes(tokens, local_vocab)
    return fused_peak_bytes(tokens, local_vocab, hidden, elem)


def _aligned(
    score: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], input_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position-aligned (logp, entropy) [B, L] from ``score(target [B, L])``, whose position t
    predicts token t+1: every position is scored (the last against a dummy target, then
    dropped) so the scored tensor enters whole, not as a copied slice; 0 at t = 0."""
    target = torch.cat([input_ids[:, 1:], input_ids.new_zeros(input_ids.shape[0], 1)], dim=1)
    logp, entropy = score(target)
    pad = logp.new_zeros(logp.shape[0], 1)
    return torch.cat([pad, logp[:, :-1]], dim=1), torch.cat([pad, entropy[:, :-1]], dim=1)


class Scoring:
    """``forward_kwargs`` for every ``GPTModel`` call, and ``token_logprobs(out, input_ids, T)``
    of the last stage's output ``out``: ``logp[b, t] = log p(input_ids[b, t] | <t)`` and the
    entropy of that distribution, both of ``softmax(logits / T)`` over the real vocabulary."""

    def __init__(
        self, impl: str, *, vocab_start: int, vocab_size: int, tp_group: dist.ProcessGroup | None
    ) -> None:
        self.impl = resolve_logprob_impl(impl)
        self.vocab_start, self.vocab_size, self.tp_group = vocab_start, vocab_size, tp_group
        fused = self.impl == "fused"
        self.forward_kwargs: dict[str, Any] = (
            {"output_processor": _hand_over_hidden} if fused else {}
        )
        self._score: Callable[[Any, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]] = (
            self._fused if fused else self._logits
        )

    def token_logprobs(
        self,
        out: HiddenStates | torch.Tensor,
        input_ids: torch.Tensor,
        temperature: float,
        shard: ContextShard | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """With a context-parallel ``shard``, ``out`` holds this CP rank's tokens of the pack
        ``input_ids`` [1, T]: they are scored against their next tokens in the pack, and the
        scores gathered back in pack order on every CP rank (the loss is then the same on
        each, and each rank's backward keeps its own tokens' rows:
        ``ContextShard.gather``)."""
        if shard is None:
            return _aligned(lambda target: self._score(out, target, temperature), input_ids)

        def score(target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logp, ent = self._score(out, target[:, shard.local], temperature)
            logp, ent = (shard.gather(x[0], replicated_loss=True) for x in (logp, ent))
            return logp.unsqueeze(0), ent.unsqueeze(0)

        return _aligned(score, input_ids)

    def _fused(
        self, out: HiddenStates, target: torch.Tensor, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_logprob_entropy(
            out.hidden, out.weight, target, temperature=temperature,
            vocab_start=self.vocab_start, vocab_size=self.vocab_size, group=self.tp_group,
        )  # fmt: skip

    def _logits(
        self, out: torch.Tensor, target: torch.Tensor, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return vocab_parallel_logprob_entropy(
            out, target, temperature=temperature,
            vocab_start=self.vocab_start, vocab_size=self.vocab_size, group=self.tp_group,
        )  # fmt: skip


def _hand_over_hidden(
    *,
    hidden_states: torch.Tensor,
    output_layer: Any,
    output_weight: torch.Tensor | None,
    **_: Any,
) -> HiddenStates:
    """GPTModel's ``output_processor`` on the last stage: apply ColumnParallelLinear's input
    region (megatron/core/tensor_parallel/layers.py ``forward``: the sequence-parallel
    all-gather, or a copy whose backward all-reduces the input gradient over TP, which the
    linear's ``allreduce_dgrad`` would do) and hand over the hidden states [s, b, h] -> [b, s, h]
    with the weight the output layer would have used (the shared embedding when tied)."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    group = output_layer.tp_group
    if output_layer.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden_states, group=group)
    else:
        hidden = copy_to_tensor_model_parallel_region(hidden_states, group=group)
    weight = output_layer.weight if output_weight is None else output_weight
    return HiddenStates(hidden.transpose(0, 1), weight)
