"""``trainer.collate.collate``: the per-sample flags the loop's overlong filter reads."""

from __future__ import annotations

from megatron_grpo.algorithms.shaping import overlong_filter_keep
from megatron_grpo.rollout.samples import Sample
from megatron_grpo.trainer.collate import collate


def test_collate_marks_truncated_responses():
    samples = [
        Sample([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], "length"),
        Sample([1], [6], [-0.5], "stop"),
    ]
    b = collate(samples, pad_id=0)
    assert b.truncated.tolist() == [True, False]
    assert overlong_filter_keep(b.truncated).tolist() == [False, True]
    # response tokens sit after the prompt; the flag does not touch the response mask itself
    assert b.response_mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
