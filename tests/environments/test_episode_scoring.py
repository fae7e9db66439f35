"""A step's rewards with multi-turn episodes: the environment's reward where it gave one, and
the reward function called on the other episodes only (no wasted calls, counters of those)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_grpo.rewards.scoring import GroupScorer


class Digits:
    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(str(t) for t in x) for x in ids]


def reward_fn(calls):
    def fn(prompts, responses, answers, rows=None):
        calls.append(list(responses))
        task = [float(r == a) for r, a in zip(responses, answers)]
        return [t + 0.5 for t in task], {"errors": 1, "task_scores": task,
                                         "task_mean": sum(task) / max(len(task), 1)}  # fmt: skip

    return fn


def sample(i, env_reward):
    return SimpleNamespace(response_ids=[i], env_reward=env_reward)


@pytest.mark.parametrize(
    "env_rewards, called",
    [
        ([None, None, None, None], ["1", "2", "3", "4"]),  # one-turn samples: all scored
        ([1.0, None, 0.0, None], ["2", "4"]),  # only what no environment scored
        ([1.0, 0.0, 0.0, 1.0], []),  # every episode scored by its environment
    ],
)
def test_the_reward_function_scores_only_what_no_environment_did(env_rewards, called):
    calls: list = []
    prompts = [
        SimpleNamespace(text="p", answer="2", row={}),
        SimpleNamespace(text="q", answer="4", row={}),
    ]
    scorer = GroupScorer(reward_fn(calls), Digits(), 2, 8, 0, 1.0)
    samples = [sample(i + 1, r) for i, r in enumerate(env_rewards)]
    rewards, info = scorer(prompts, samples)
    assert calls == [called]
    by_fn = {"1": 0.5, "2": 1.5, "3": 0.5, "4": 1.5}  # +0.5: the fake's format bonus
    want = [r if r is not None else by_fn[str(i + 1)] for i, r in enumerate(env_rewards)]
    assert rewards.view(-1).tolist() == want
    task = [r if r is not None else by_fn[str(i + 1)] - 0.5 for i, r in enumerate(env_rewards)]
    assert info["task_scores"] == task and info["task_mean"] == pytest.approx(sum(task) / 4)
