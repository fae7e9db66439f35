"""``algorithms.seeds``: each stream's seed is exactly the value the code has always derived
(the golden numbers depend on them), and the streams stay apart where they must."""

from __future__ import annotations

from megatron_grpo.algorithms import seeds


def test_each_stream_gives_todays_values():
    for seed, step in ((0, 1), (3, 7), (1234, 250)):
        assert seeds.advantage_seed(seed, step) == seed * 1_000_003 + step
        assert seeds.mini_batch_seed(seed, step) == seed * 7_654_321 + step
        assert seeds.sampling_seed(seed, step) == seed + 7919 * step
    assert seeds.validation_seed(5) == 5 + 104_729
    assert [seeds.replica_offset(i) for i in range(3)] == [0, 1_000_003, 2_000_006]


def test_steps_request_seeds_do_not_overlap_below_the_stride():
    """Request i of a step takes ``sampling_seed + i * n`` and its samples ``+0..n-1``."""
    n, prompts = 8, 64  # 512 samples per step < 7919
    used = [
        {seeds.sampling_seed(0, s) + k for k in range(prompts * n)} for s in range(1, 20)
    ]  # fmt: skip
    assert all(not (a & b) for i, a in enumerate(used) for b in used[i + 1 :])
