"""grpo.dynamic_sampling: every trained batch is full of groups whose rewards differ (or the
step says how short it was), picked deterministically, the same with or without
rollout.ahead, and a resumed run picks the same groups."""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.algorithms.dynamic_sampling import Round, fill_batch, has_signal, merge_info
from megatron_grpo.algorithms.seeds import round_seed, sampling_seed
from megatron_grpo.config import ConfigError, load_config
from megatron_grpo.config.schema import DynamicSamplingConfig
from megatron_grpo.data.prompts import LoadReport, Prompt, PromptSource
from megatron_grpo.rollout.ahead import WindowBuffer

G = 4


def source(n: int = 40, seed: int = 7) -> PromptSource:
    prompts = [Prompt(f"p{i}", [i], str(i)) for i in range(n)]
    return PromptSource(prompts, seed, LoadReport("test", n, n))


def kind(prompt_id: int) -> str:
    """A third of the prompts are always wrong, a third always right, a third mixed."""
    return ("wrong", "right", "mixed")[prompt_id % 3]


def launch_recording(calls: list):
    """``Rollout.launch`` of a fake engine: G samples per prompt, each ``(prompt id, seed)``."""

    def launch(steps):
        calls.append([seed for _, seed in steps])
        return [
            lambda ids=ids, seed=seed: [(p[0], seed + i * G + j) for i, p in enumerate(ids) for j in range(G)]
            for ids, seed in steps
        ]  # fmt: skip

    return launch


def score(prompts, samples):
    """GroupScorer's shape: rewards [P, G] and an info with per-response task scores."""
    rows = []
    for p in prompts:
        k = kind(p.prompt_ids[0])
        rows.append([0.0] * G if k == "wrong" else [1.0] * G if k == "right" else [0.0, 1.0] * (G // 2))  # fmt: skip
    rewards = torch.tensor(rows)
    flat = rewards.reshape(-1).tolist()
    info = {"errors": 1, "total_errors": 10 + len(samples), "task_mean": sum(flat) / len(flat),
            "task_scores": flat}  # fmt: skip
    return rewards, info


def buffer(src, *, ahead=0, oversample=1.5, max_rounds=3, p=4, calls=None):
    ds = DynamicSamplingConfig(enabled=True, oversample=oversample, max_rounds=max_rounds)
    return WindowBuffer(src, p, ahead, 3, 9, 5, launch_recording([] if calls is None else calls),
                        score, dynamic=ds)  # fmt: skip


def run(buf, steps):
    out = {}
    for s in steps:
        prompts, samples = buf.take(s)
        rewards, info = buf.take_scores()
        out[s] = ([p.prompt_ids[0] for p in prompts], samples, rewards, info)
    return out


def test_every_batch_is_full_of_groups_with_signal_and_consistent():
    got = run(buffer(source(), max_rounds=6), range(1, 10))
    assert any(info["ds_rounds"] > 1 for *_, info in got.values())  # further rounds ran
    for ids, samples, rewards, info in got.values():
        assert len(ids) == 4 and rewards.shape == (4, G) and len(samples) == 4 * G
        assert all(has_signal(rewards)) and info["ds_fill"] == 1.0
        assert all(kind(i) == "mixed" for i in ids)
        # samples, rewards and the per-response task scores line up group by group
        assert [s[0] for s in samples] == [i for i in ids for _ in range(G)]
        assert info["task_scores"] == rewards.reshape(-1).tolist()
        assert info["ds_generated"] == 6 * info["ds_rounds"]
        assert info["ds_signal"] >= 4


def test_short_steps_are_made_up_with_zero_variance_groups_and_say_so():
    """One round of 4 prompts cannot hold 4 mixed groups here: the batch is still 4 groups
    (the rest zero-variance, after the ones with signal) and ds_fill says how many had it."""
    got = run(buffer(source(), oversample=1.0, max_rounds=1), range(1, 4))
    for *_, rewards, info in got.values():
        signal = has_signal(rewards)
        n = sum(signal)
        assert n < 4 and signal == [True] * n + [False] * (4 - n)
        assert info["ds_fill"] == n / 4 and info["ds_rounds"] == 1 and info["ds_generated"] == 4


def test_further_rounds_draw_a_second_data_pass_with_their_own_seeds():
    calls: list = []
    src = source()
    run(buffer(src, calls=calls), [1])
    assert calls[0] == [sampling_seed(5, 1)] and len(calls) > 1
    assert all(c == [round_seed(5, 1, r)] for r, c in enumerate(calls[1:], 1))
    assert src.state_dict()["index"] == 6  # the main pass moved by the step's own round only


@pytest.mark.parametrize("ahead", [0, 2])
def test_ahead_and_resume_pick_the_same_groups(ahead):
    want = run(buffer(source(), ahead=0), range(1, 10))
    assert any(w[3]["ds_rounds"] > 1 for w in want.values())  # further rounds ran
    buf = buffer(source(), ahead=ahead)
    got = run(buf, range(1, 5))
    state = buf.data_state()  # the checkpoint after step 4 (mid-window with ahead=2)
    assert "refill" in state
    resumed = buffer(source(), ahead=ahead)
    resumed.load_data_state(state)
    got.update(run(resumed, range(5, 10)))
    for s in range(1, 10):
        assert got[s][0] == want[s][0] and got[s][1] == want[s][1], s
        assert torch.equal(got[s][2], want[s][2])


def test_merged_info_counts_add_totals_are_the_last_means_cover_every_response():
    infos = [
        {"errors": 1, "total_errors": 5, "task_mean": 0.5, "task_scores": [0, 1, 1, 1], "name": "x"},
        {"errors": 2, "total_errors": 7, "task_mean": 1.0, "task_scores": [1, 1, 0, 0, 1, 0]},
    ]  # fmt: skip
    out = merge_info(infos, [4, 6], [(1, 2), (0, 0)], 2)
    assert out["errors"] == 3 and out["total_errors"] == 7 and out["name"] == "x"
    assert out["task_mean"] == pytest.approx((0.5 * 4 + 1.0 * 6) / 10)
    assert out["task_scores"] == [1, 0, 0, 1]


def test_fill_batch_refuses_rounds_smaller_than_the_batch():
    r = Round([object()], [0] * G, torch.zeros(1, G), {"task_scores": [0.0] * G})
    with pytest.raises(ValueError, match="fewer than the step's prompts_per_step=2"):
        fill_batch([r], 2)


@pytest.mark.parametrize(
    "override, match",
    [
        ("grpo.dynamic_sampling.oversample=0.5", "oversample=0.5 must be >= 1"),
        ("grpo.dynamic_sampling.max_rounds=0", "max_rounds=0 must be an integer >= 1"),
    ],
)
def test_bad_settings_are_refused_in_one_line(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])
