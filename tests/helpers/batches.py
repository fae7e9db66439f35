"""The step's staged values (``megatron_grpo.algorithms.step_batch``) built from just the
tensors a test cares about: ``rows`` for a log-prob pass, ``advantaged`` for an SGD pass
with a test's own loss, ``loss_batch`` for ``GRPOLoss`` / the policy losses."""

from __future__ import annotations

import torch

from megatron_grpo.algorithms.aggregation import compute_global_normalizers
from megatron_grpo.algorithms.step_batch import (
    AdvantagedBatch,
    LossBatch,
    Normalizers,
    Rows,
    extend,
)


def rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kw) -> Rows:
    return Rows(input_ids=input_ids, attention_mask=attention_mask, **kw)


def advantaged(
    input_ids: torch.Tensor | None = None,
    *,
    loss_mask: torch.Tensor,
    advantages: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    alpha_engine_logp: torch.Tensor | None = None,
    routed_experts: torch.Tensor | None = None,
) -> AdvantagedBatch:
    """An ``AdvantagedBatch`` of ``loss_mask``'s shape: token 0 and a full attention mask
    where not given, ``response_mask`` = ``loss_mask``, advantages 1, engine log-probs 0."""
    b = loss_mask.shape[0]
    ids = torch.zeros(loss_mask.shape, dtype=torch.long) if input_ids is None else input_ids
    resp = loss_mask if response_mask is None else response_mask
    return AdvantagedBatch(
        input_ids=ids,
        attention_mask=torch.ones(ids.shape) if attention_mask is None else attention_mask,
        response_mask=resp,
        alpha_engine_logp=torch.zeros(loss_mask.shape)
        if alpha_engine_logp is None
        else alpha_engine_logp,
        truncated=torch.zeros(b, dtype=torch.bool),
        advantages=torch.ones(b) if advantages is None else advantages,
        loss_mask=loss_mask,
        routed_experts=routed_experts,
    )


def loss_batch(
    *,
    loss_mask: torch.Tensor,
    advantages: torch.Tensor,
    alpha_engine_logp: torch.Tensor,
    pi_k_logp: torch.Tensor | None = None,
    alpha_trainer_logp: torch.Tensor | None = None,
    pi_ref_logp: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    normalizers: Normalizers | None = None,
) -> LossBatch:
    """A ``LossBatch`` with the roles given; normalizers of one rank over ``loss_mask``
    unless given."""
    base = advantaged(
        loss_mask=loss_mask,
        advantages=advantages,
        response_mask=response_mask,
        alpha_engine_logp=alpha_engine_logp,
    )
    return extend(
        LossBatch,
        base,
        pi_k_logp=pi_k_logp,
        alpha_trainer_logp=alpha_trainer_logp,
        pi_ref_logp=pi_ref_logp,
        normalizers=compute_global_normalizers(loss_mask) if normalizers is None else normalizers,
    )


def with_normalizers(batch: AdvantagedBatch, normalizers: Normalizers | None = None) -> LossBatch:
    """``batch`` as a ``LossBatch`` (its own one-rank normalizers unless given)."""
    norms = compute_global_normalizers(batch.loss_mask) if normalizers is None else normalizers
    return extend(LossBatch, batch, normalizers=norms)
