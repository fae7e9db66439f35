"""Multi-turn episodes end to end (``env.name``, docs/environments.md): real Megatron-core
training on real vLLM rollouts (CPU), colocated with window-ahead generation and a resume,
and disaggregated. Each run is its own process with a timeout (tests/helpers/runs.py)."""

from __future__ import annotations

import pytest

from tests.helpers.runs import (
    FAST,
    RESUME_KEYS,
    assert_same_rows,
    rows,
    stopped_copy,
    torchrun_train,
    train,
)

pytestmark = pytest.mark.slow

ENV = ["env.name=tests.helpers.envs:TwoTurns", "rollout.max_new_tokens=12", "env.max_turns=3"]
RUN = ["--sync-interval", "2", "rollout.ahead=1", "checkpoint.interval=2", "eval.interval=2",
       "eval.num_prompts=4", *FAST, *ENV]  # fmt: skip
EPISODE_KEYS = ["turns_mean", "turns_max", "env_calls", "env_errors", "env_truncated",
                "env_token_frac"]  # fmt: skip


def _check_episodes(r: list[dict]) -> None:
    assert all(x["turns_max"] >= 2 and 1 <= x["turns_mean"] <= 3 for x in r), r
    assert all(0 < x["env_token_frac"] < 1 for x in r)
    assert all(x["env_errors"] == 0 and x["env_timeouts"] == 0 for x in r)
    # At lag 0 vLLM serves the trainer's weights: the trainer's log-probs of the model's
    # tokens of every turn, after the environment's tokens, equal the engine's (ratio 1).
    for x in r:
        if x["lag"] == 0:
            assert abs(x["ratio_mean"] - 1.0) < 1e-4, x


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    run = tmp_path_factory.mktemp("episodes") / "run"
    rc, out = train(run, "--steps", "4", *RUN)
    assert rc == 0, out[-3000:]
    return run


@pytest.mark.timeout(600)
def test_colocated_episodes_with_window_ahead_train_and_validate(four_steps):
    r = rows(four_steps)
    assert [x["step"] for x in r] == [1, 2, 3, 4]
    assert [x["policy_version"] for x in r] == [0, 0, 2, 2]
    _check_episodes(r)
    assert [x.get("eval_policy_version") for x in r] == [None, 2, None, 4]


@pytest.mark.timeout(600)
def test_resumed_multi_turn_run_equals_uninterrupted(four_steps, tmp_path):
    part = tmp_path / "part"
    stopped_copy(four_steps, part, 2)
    rc, out = train(part, "--steps", "4", "--resume", *RUN)
    assert rc == 0, out[-3000:]
    a, b = rows(four_steps), rows(part)
    assert [x["step"] for x in b] == [1, 2, 3, 4]
    assert_same_rows(a, b)
    for x, y in zip(a, b):
        assert {k: x[k] for k in EPISODE_KEYS} == {k: y[k] for k in EPISODE_KEYS}
    assert "turns_mean" not in RESUME_KEYS  # compared here, exactly


@pytest.mark.timeout(900)
def test_disaggregated_episodes_cross_the_control_channel(tmp_path):
    run = tmp_path / "run"
    rc, out, left = torchrun_train(
        run, "--steps", "2", "--sync-interval", "1", "rollout.placement=disaggregated",
        "rollout.num_engines=1", *FAST, *ENV, timeout=840,
    )  # fmt: skip
    assert rc == 0, out[-4000:]
    assert not left, f"processes of the run still alive after it ended: {left}"
    _check_episodes(rows(run))


@pytest.mark.timeout(400)
def test_eval_dump_of_episodes_marks_the_environments_tokens(four_steps, tmp_path):
    from tests.helpers.commands import cli, read_dump

    model = four_steps / "hf_model" / "tiny"
    dump = tmp_path / "dump.jsonl"
    rc, out = cli("eval", "--model", str(model), "--data", "synthetic:max", "--limit", "3",
                  "--samples", "2", "--max-new-tokens", "12", "--dump", str(dump),
                  "rollout.cpu_kv_cache_gb=0.25", *ENV[:1], "env.max_turns=3")  # fmt: skip
    assert rc == 0, out[-4000:]
    got = read_dump(dump)
    assert len(got) == 6 and any(r["turns"] == 2 for r in got)
    for r in got:
        mask, lps = r["response_mask"], r["logprobs"]
        assert len(mask) == len(lps) == len(r["response_token_ids"])
        assert all((lp is None) == (m == 0) for lp, m in zip(lps, mask))
        assert r["turns"] >= 1 and r["env_end"] in ("done", "max_turns", "truncated")
