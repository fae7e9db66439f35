"""The step batch: the one set of tensors the loop builds, the policy slices into
micro-batches and the loss reads, each key's meaning said once, here.

Rows are sequences, prompt-major (the G samples of prompt p at rows ``[p*G, (p+1)*G)``);
``[B, L]`` tensors are right-padded and position-aligned: the value of response token j sits
at index ``len(prompt) + j``, and ``logp[b, t]`` is the log-prob of token ``t`` given the
tokens before it. The policy passes every key it does not use to ``loss_fn`` unchanged,
sliced per micro-batch (docs/architecture-policy.md, "The policy's contracts").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypedDict

from torch import Tensor


class StepBatch(TypedDict, total=False):
    """One step's batch (or a DP shard, mini-batch or micro-batch of it)."""

    input_ids: Tensor
    """``[B, L]`` long: prompt + response, right-padded (trainer/collate.py ``collate``)."""
    attention_mask: Tensor
    """``[B, L]``: 1 on real tokens; trims each micro-batch to its longest row."""
    loss_mask: Tensor
    """``[B, L]``: 1 on the response tokens that get gradient: 0 on prompt and padding, and
    on samples the advantage step (zero variance, RED-Drop) or the overlong filter dropped."""
    response_mask: Tensor
    """``[B, L]``: every response token, before any sample is dropped
    (``grpo.loss_normalizer=all`` counts these)."""
    response_len: Tensor
    """``[B]`` long: response tokens per row."""
    truncated: Tensor
    """``[B]`` bool: the response hit ``rollout.max_new_tokens``."""
    rollout_logp: Tensor
    """``[B, L]``: alpha's log-probs, returned by vLLM with the samples; 0 off the response."""
    old_logp: Tensor
    """``[B, L]``: pi_k's log-probs, scored on the trainer before the step's first update
    (``grpo.ratio_mode=exact``)."""
    alpha_logp: Tensor
    """``[B, L]``: alpha's weights scored on the trainer's numerics (``grpo.score_alpha``,
    algorithms/staleness.py)."""
    ref_logp: Tensor
    """``[B, L]``: pi_ref's log-probs (a KL term to the reference)."""
    advantages: Tensor
    """``[B]``: one per sequence, broadcast over its tokens."""
    global_num_tokens: Tensor
    """0-dim: loss tokens over the mini-batch's micro-batches and DP ranks
    (``grpo.loss_agg=token_mean``); set once per mini-batch."""
    global_num_seqs: Tensor
    """0-dim: sequences with at least one loss token, same span (the ``seq_mean_*`` modes)."""
    global_num_rows: Tensor
    """0-dim: sequences in the mini-batch over all DP ranks, masked or not
    (``grpo.loss_agg=constant``)."""


LossFn = Callable[[Tensor, Tensor, StepBatch], tuple[Tensor, dict[str, Tensor]]]
"""``loss_fn(logp, entropy, mb) -> (loss, metrics)``: one micro-batch's share of the global
objective (algorithms/aggregation.py ``make_loss_fn``)."""
