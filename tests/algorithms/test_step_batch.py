"""A step's data in frozen stages (``algorithms/step_batch.py``): made, never edited; cut into
micro-batches of the same stage; what moves to the device and back."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_grpo.algorithms.advantages import Advantages
from megatron_grpo.algorithms.step_batch import (
    AdvantagedBatch,
    LossBatch,
    Rows,
    SampledBatch,
    ScoredBatch,
    extend,
)
from megatron_grpo.policy.micro_batches import micro_batches, packed_micro_batches
from megatron_grpo.rollout.samples import Sample
from megatron_grpo.trainer.collate import collate, dp_shard, mini_batches, with_advantages
from tests.helpers.batches import loss_batch
from tests.helpers.numerics import t


def _sampled() -> SampledBatch:
    samples = [
        Sample([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], "length"),
        Sample([1], [6], [-0.5], "stop"),
    ]
    return collate(samples, pad_id=0)


def test_each_stage_is_made_from_the_one_before_and_never_edited():
    sampled = _sampled()
    want = t([[0, 0, -0.1, -0.2, -0.3], [0, -0.5, 0, 0, 0]])
    assert torch.equal(sampled.alpha_engine_logp, want)
    adv = Advantages(advantages=t([[1.0, -1.0]]), keep=torch.tensor([[True, False]]), metrics={})
    advantaged = with_advantages(sampled, adv, overlong_filter=False)
    assert isinstance(advantaged, SampledBatch)  # every field of the stage before it
    assert advantaged.input_ids is sampled.input_ids
    # loss_mask is made once, here: the response tokens of the kept samples; response_mask
    # (every response token) keeps its meaning
    assert advantaged.loss_mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]]
    assert advantaged.response_mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    # DAPO's overlong filter drops the truncated sample 0 as well
    filtered = with_advantages(sampled, adv, overlong_filter=True)
    assert filtered.loss_mask.sum() == 0
    scored = extend(ScoredBatch, advantaged, pi_k_logp=torch.zeros(2, 5))
    assert scored.pi_ref_logp is None and scored.alpha_trainer_logp is None
    for value, field in ((sampled, "response_mask"), (advantaged, "loss_mask"),
                         (scored, "pi_k_logp")):  # fmt: skip
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field, torch.zeros(2, 5))


def test_a_tensor_off_the_batch_dim_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"AdvantagedBatch.advantages has shape \(3,\), input_ids"):
        extend(AdvantagedBatch, _sampled(), advantages=torch.zeros(3), loss_mask=torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"input_ids must be \[B, L\]"):
        Rows(input_ids=torch.zeros(4, dtype=torch.long))


def test_shards_mini_and_micro_batches_are_values_of_the_same_stage():
    mb = loss_batch(loss_mask=torch.ones(4, 3), advantages=torch.arange(4.0),
                    alpha_engine_logp=torch.zeros(4, 3))  # fmt: skip
    shard = dp_shard(mb, 1, 2)
    assert type(shard) is LossBatch and shard.advantages.tolist() == [2.0, 3.0]
    assert shard.normalizers is mb.normalizers  # a mini-batch's, not cut per row
    parts = mini_batches(mb, 2, 1, torch.Generator().manual_seed(0))
    assert all(type(p) is LossBatch for p in parts)
    assert sorted(sum((p.advantages.tolist() for p in parts), [])) == [0.0, 1.0, 2.0, 3.0]
    for _, _, micro in micro_batches(mb, 3):
        assert type(micro) is LossBatch


def test_device_round_trip_keeps_the_stage_and_its_normalizers():
    mb = loss_batch(loss_mask=torch.ones(2, 3), advantages=torch.ones(2),
                    alpha_engine_logp=torch.zeros(2, 3))  # fmt: skip
    tensors = mb.tensors()
    assert "normalizers.num_tokens" in tensors and "pi_k_logp" not in tensors  # None: not sent
    back = mb.with_tensors({k: v + 1 for k, v in tensors.items()})
    assert type(back) is LossBatch
    assert float(back.normalizers.num_tokens) == float(mb.normalizers.num_tokens) + 1
    assert back.loss_mask.tolist() == [[2.0] * 3] * 2


def test_padding_a_micro_batch_gives_routed_experts_minus_one():
    # Sequence parallelism pads each micro-batch to a multiple of tp: a padded position has
    # no vLLM expert (-1: the router's own choice, no mismatch counted), not expert 0.
    routed = torch.full((2, 5, 1, 2), 7, dtype=torch.int16)
    ids = torch.ones(2, 5, dtype=torch.long)
    batch = Rows(input_ids=ids, attention_mask=torch.ones(2, 5), routed_experts=routed)
    ((_, length, mb),) = micro_batches(batch, 2, multiple=4)
    assert length == 5 and mb.input_ids.shape == (2, 8)
    assert (mb.routed_experts[:, 5:] == -1).all() and (mb.routed_experts[:, :5] == 7).all()
    assert (mb.input_ids[:, 5:] == 0).all()
    ((_, _, packed_rows, pack),) = packed_micro_batches(batch, 100, multiple=4)
    assert (pack.routed_experts[10:] == -1).all()
    assert packed_rows.routed_experts.shape == (2, 5, 1, 2)
