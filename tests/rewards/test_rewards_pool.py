"""Time-limited reward workers: math_verify and user functions under adversarial inputs.

The helper rewards below are imported by the spawned workers through their dotted path
``tests.rewards.test_rewards_pool:<name>``; this module imports no torch so workers start fast.
"""

from __future__ import annotations

import os
import time

import pytest

from megatron_grpo.config.schema import DataConfig, RewardConfig
from megatron_grpo.rewards import build_reward
from megatron_grpo.rewards.pool import DeadlinePool

HERE = "tests.rewards.test_rewards_pool"
FILE_DATA = DataConfig(source="data.jsonl")


def sleepy(prompt: str, response: str, answer: str) -> float:
    if response == "hang":
        while True:
            time.sleep(0.05)
    return float(response == answer)


def raising(prompt: str, response: str, answer: str) -> float:
    raise ZeroDivisionError(f"cannot score {response}")


def dying(prompt: str, response: str, answer: str) -> float:
    if response == "die":
        os._exit(3)
    return 1.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a killed child not yet reaped is a zombie; treat it as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_user_reward_timeout_kills_and_replaces_worker():
    cfg = RewardConfig(name=f"{HERE}:sleepy", timeout_s=1.0, num_workers=2)
    with build_reward(cfg, FILE_DATA) as fn:
        fn._pool.wait_ready()
        pids = set(fn._pool.pids)
        t0 = time.monotonic()
        rewards, info = fn(["p"] * 4, ["a", "hang", "b", "hang"], ["a", "a", "c", "a"])
        took = time.monotonic() - t0
        assert rewards == [1.0, 0.0, 0.0, 0.0]
        assert info["timeouts"] == 2 and info["errors"] == 0
        assert took < 1.0 * 2 + 1.5  # two rounds of deadlines at most, plus slack
        assert fn._pool.restarts == 2
        # the pool keeps working after replacing workers
        rewards, info = fn(["p"] * 3, ["a", "b", "c"], ["a", "b", "x"])
        assert rewards == [1.0, 1.0, 0.0] and info["timeouts"] == 0
        new_pids = set(fn._pool.pids)
    time.sleep(0.2)
    assert not any(_alive(p) for p in pids | new_pids)  # close() stopped every worker


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_user_reward_raise_and_death_score_zero(caplog):
    with build_reward(RewardConfig(name=f"{HERE}:raising", num_workers=1), FILE_DATA) as fn:
        with caplog.at_level("WARNING"):
            rewards, info = fn(["p1", "p2"], ["r1", "r2"], ["a", "a"])
        assert rewards == [0.0, 0.0] and info["errors"] == 2
        msgs = [r.getMessage() for r in caplog.records if "ZeroDivisionError" in r.getMessage()]
        assert len(msgs) == 1 and "r1" in msgs[0]
    with build_reward(RewardConfig(name=f"{HERE}:dying", num_workers=1), FILE_DATA) as fn:
        rewards, info = fn(["p"] * 3, ["ok", "die", "ok"], ["a"] * 3)
        assert rewards == [1.0, 0.0, 1.0] and info["errors"] == 1


USER_FILE = """
def length_match(prompt, response, answer):
    return float(len(response) == int(answer))
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_user_reward_from_a_file_path(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text(USER_FILE)
    monkeypatch.chdir(tmp_path)  # a path relative to the working directory, as users write it
    cfg = RewardConfig(name="my_reward.py:length_match", num_workers=1)
    with build_reward(cfg, FILE_DATA) as fn:
        rewards, info = fn(["p"] * 3, ["ab", "abc", ""], ["2", "2", "0"])
    assert rewards == [1.0, 0.0, 1.0] and info["errors"] == 0
    with pytest.raises(ValueError, match=r"reward file 'nope.py' .* does not exist"):
        build_reward(RewardConfig(name="nope.py:fn"), FILE_DATA)
    with pytest.raises(ValueError, match="has no attribute 'other'"):
        build_reward(RewardConfig(name="my_reward.py:other"), FILE_DATA)


MATH_CASES = [
    # (response, gold, expected score)
    ("so x = \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("the answer is \\boxed{0.5}", "\\frac12", 1.0),
    ("\\boxed{3}", "4", 0.0),
    ("We get $\\boxed{(1, 2)}$.", "(1,2)", 1.0),
    ("no answer at all", "5", 0.0),
]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_math_verify_reward_golden():
    with build_reward(
        RewardConfig(name="math", timeout_s=10.0, format_weight=0.5), FILE_DATA
    ) as fn:
        rewards, info = fn(
            ["q"] * len(MATH_CASES), [c[0] for c in MATH_CASES], [c[1] for c in MATH_CASES]
        )
    # format reward: +0.5 when the response has \boxed{...}
    expected = [c[2] + (0.5 if "\\boxed{" in c[0] else 0.0) for c in MATH_CASES]
    assert rewards == pytest.approx(expected)
    assert info["errors"] == 0 and info["timeouts"] == 0


def _nested_frac(depth: int) -> str:
    s = "1"
    for _ in range(depth):
        s = "\\frac{" + s + "}{2}"
    return s


ADVERSARIAL = [
    "\\boxed{" + "9" * 100_000 + "}",  # a 100k-digit number
    "\\boxed{10^{100000}}",
    "\\boxed{10^{10^{10^{10}}}}",  # a power tower sympy would try to evaluate
    "\\boxed{" + "9" * 5000 + "!}",  # factorial of a huge number
    "\\boxed{" + _nested_frac(400) + "}",  # deeply nested \frac{\frac{...}}
    "\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}",
    "\\boxed{" * 2000 + "1" + "}" * 2000,
    "\\boxed{ｘ＝１２ ∑∫√ \u202e 𝟙𝟚 \x00}",  # unicode lookalikes, bidi override, NUL
    "$" * 20_000 + "\\boxed{" + "{" * 20_000,  # unbalanced delimiters
]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_math_verify_adversarial_answers_return_within_limit():
    timeout_s = 1.0
    cfg = RewardConfig(name="math", timeout_s=timeout_s, num_workers=2)
    with build_reward(cfg, FILE_DATA) as fn:
        for response in ADVERSARIAL:
            fn._pool.wait_ready(1)  # workers killed by earlier cases may be re-importing
            t0 = time.monotonic()
            rewards, info = fn(["q"], [response], ["12"])
            took = time.monotonic() - t0
            assert took < timeout_s + 1.0, (response[:60], took)  # 1 s slack: loaded CI
            assert rewards == [0.0]
        # adversarial golds too (a dataset row can be crafted): both run in parallel, bounded
        fn._pool.wait_ready()
        t0 = time.monotonic()
        rewards, _ = fn(["q"] * 2, ["\\boxed{1}"] * 2, [ADVERSARIAL[2][7:-1], _nested_frac(400)])
        assert time.monotonic() - t0 < timeout_s + 1.0
        # after all that, a normal call still scores
        fn._pool.wait_ready()
        assert fn(["q"], ["\\boxed{7}"], ["7"])[0] == [1.0]
        assert fn.total_timeouts >= 3  # the power tower, deep \frac nesting and parens


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_pool_reports_a_target_that_cannot_load():
    pool = DeadlinePool("no_such_module_xyz:fn", num_workers=1, timeout_s=1.0)
    try:
        with pytest.raises(RuntimeError, match="cannot load"):
            pool.map([("p", "r", "a")])
        with pytest.raises(RuntimeError, match="cannot load"):
            DeadlinePool("no_such_module_xyz:fn", num_workers=1, timeout_s=1.0).wait_ready()
    finally:
        pool.close()
