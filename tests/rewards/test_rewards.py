"""Reward functions: GSM8K, synthetic tasks, format rewards, in-process adversarial inputs."""

from __future__ import annotations

import time

import pytest

from megatron_grpo.config.schema import DataConfig, RewardConfig
from megatron_grpo.rewards import build_reward
from megatron_grpo.rewards import gsm8k as g
from megatron_grpo.rewards.synthetic import (
    TASKS,
    char_match_score,
    synthetic_example,
    synthetic_format,
)


def test_gsm8k_gold_and_strict():
    gold = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 1,072"
    assert g.extract_gold(gold) == "1072"
    assert g.gsm8k_strict("", "She sold 1072 clips.\n#### $1,072", gold) == 1.0
    assert g.gsm8k_strict("", "#### 1072.00", gold) == 1.0
    assert g.gsm8k_strict("", "#### 1072.", gold) == 1.0
    assert g.gsm8k_strict("", "The answer is 1072", gold) == 0.0  # no #### -> strict fails
    assert g.gsm8k_strict("", "#### 1071", gold) == 0.0
    assert g.gsm8k_strict("", "#### -5", "#### -5") == 1.0
    assert g.gsm8k_strict("", "#### 12 then #### 13", "12") == 1.0  # first match counts
    assert g.gsm8k_strict("", "####", "12") == 0.0


def test_gsm8k_flexible_last_number():
    assert g.gsm8k_flexible("", "3 + 4 = 7, so 70 apples", "#### 70") == 1.0
    assert g.gsm8k_flexible("", "it is $1,000.", "#### 1000") == 1.0
    assert g.gsm8k_flexible("", "70 apples, or maybe 71", "#### 70") == 0.0
    assert g.gsm8k_flexible("", "no numbers here", "#### 70") == 0.0


def test_gsm8k_format_rewards_only_a_hash_answer_line():
    assert g.gsm8k_format("blah\n#### 42") == 1.0
    assert g.gsm8k_format("blah 42") == 0.0


@pytest.mark.parametrize(
    "response",
    [
        "#### " + "9" * 100_000,  # a huge number: Decimal has no digit limit, linear
        "#### " + "1," * 50_000 + "x",
        "," * 100_000,  # would be quadratic with an overlapping number regex
        "$" * 100_000 + "####" + " " * 100_000,
        "-" * 100_000,
        "١٢٣ ٤٥ #### ３ 𝟙𝟚 \u202e 12 \x00",  # unicode digits, bidi override, NUL
    ],
)
@pytest.mark.parametrize("name", ["gsm8k", "gsm8k_flexible"])
def test_gsm8k_adversarial_inputs_are_fast(name, response):
    fn = build_reward(
        RewardConfig(name=name, timeout_s=1.0, format_weight=0.5), DataConfig(source="g.jsonl")
    )
    t0 = time.monotonic()
    rewards, info = fn(["q"], [response], ["#### 12"])
    assert time.monotonic() - t0 < 1.0
    assert info["errors"] == 0 and info["timeouts"] == 0
    assert 0.0 <= rewards[0] <= 1.5


def test_synthetic_tasks_deterministic_and_exact():
    for name in TASKS:
        a = [synthetic_example(name, 2, i) for i in range(20)]
        assert a == [synthetic_example(name, 2, i) for i in range(20)]
        assert a != [synthetic_example(name, 2, i, split="test") for i in range(20)]
    assert synthetic_example("add", 1, 0) == ("4+7=", "11")
    p, ans = synthetic_example("add", 3, 5)
    x, y = p.rstrip("=").split("+")
    assert int(x) + int(y) == int(ans) and max(int(x), int(y)) < 1000
    p, ans = synthetic_example("reverse", 1, 0)
    assert p == f"rev {ans[::-1]}=" and len(ans) == 3
    p, ans = synthetic_example("max", 2, 3)
    assert ans == max(p[4:-1].split()) and len(p[4:-1].split()) == 3
    with pytest.raises(ValueError, match="synthetic:add"):
        synthetic_example("mul", 1, 0)


def test_synthetic_partial_credit():
    # per-character credit / max(len): "1" vs "11" -> 1/2; "11" exact -> 1; "115" -> 2/3;
    # "21" -> 1/2 (second char matches); whitespace around the answer is ignored.
    assert char_match_score("1", "11") == 0.5
    assert char_match_score(" 11\n", "11") == 1.0
    assert char_match_score("115", "11") == pytest.approx(2 / 3)
    assert char_match_score("21", "11") == 0.5
    assert char_match_score("", "7") == 0.0
    assert synthetic_format("12") == 1.0 and synthetic_format("1a") == 0.0
    fn = build_reward(RewardConfig(name="synthetic", format_weight=0.1), DataConfig())
    rewards, info = fn(["4+7="] * 3, ["11", "1", "x"], ["11"] * 3)
    # 1 + 0.1 * 1; 0.5 + 0.1 * 1; 0 + 0.1 * 0
    assert rewards == pytest.approx([1.1, 0.6, 0.0])
    assert info["task_mean"] == pytest.approx(0.5)
    assert info["task_scores"] == pytest.approx([1.0, 0.5, 0.0])  # no format bonus


def test_inprocess_reward_error_is_counted_and_logged_once(caplog, monkeypatch):
    from megatron_grpo.rewards import builder

    def boom(prompt, response, answer):
        raise RuntimeError("bad reward")

    monkeypatch.setitem(builder._INPROCESS, "synthetic", (boom, synthetic_format))
    fn = build_reward(RewardConfig(name="synthetic"), DataConfig())
    with caplog.at_level("WARNING"):
        rewards, info = fn(["p1", "p2"], ["r1", "r2"], ["a", "a"])
        fn(["p3"], ["r3"], ["a"])
    assert rewards == [0.0, 0.0] and info["errors"] == 2
    assert fn.total_errors == 3
    logged = [r for r in caplog.records if "bad reward" in r.getMessage()]
    assert len(logged) == 1 and "p1" in logged[0].getMessage()


def test_build_reward_errors_name_the_fix():
    with pytest.raises(ValueError, match="reward.name=synthetic"):
        build_reward(RewardConfig(name="gsm8k"), DataConfig(source="synthetic:add"))
    with pytest.raises(ValueError, match="neither a built-in reward"):
        build_reward(RewardConfig(name="nosuch"), DataConfig(source="x.jsonl"))
    with pytest.raises(ValueError, match="cannot import module"):
        build_reward(RewardConfig(name="no_such_pkg.mod:fn"), DataConfig(source="x.jsonl"))
    with pytest.raises(ValueError, match="no attribute"):
        build_reward(RewardConfig(name="megatron_grpo.rewards.gsm8k:nope"), None)
    with pytest.raises(ValueError, match="format_weight"):
        build_reward(
            RewardConfig(name="megatron_grpo.rewards.gsm8k:gsm8k_strict", format_weight=1.0), None
        )
    with pytest.raises(ValueError, match="lengths differ"):
        build_reward(RewardConfig(name="synthetic"), None)(["a"], [], [])
