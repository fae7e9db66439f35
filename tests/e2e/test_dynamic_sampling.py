"""grpo.dynamic_sampling end to end: real vLLM rollouts, real rewards, real training. Every
trained batch holds only groups whose rewards differ (or the step says it ran short), and a
run resumed from a checkpoint inside the run picks the same groups."""

from __future__ import annotations

import pytest

from tests.helpers.runs import FAST, assert_same_rows, rows, stopped_copy, train

pytestmark = pytest.mark.slow

DS_KEYS = ("ds_generated", "ds_signal", "ds_rounds", "ds_fill", "ds_reward_mean")
# v=2 with rollout.ahead=1: steps 1-2 and 3-4 are each generated in one window, further
# rounds after it; the step-2 checkpoint sits between windows.
DS = ["--sync-interval", "2", "grpo.dynamic_sampling.enabled=true",
      "grpo.dynamic_sampling.max_rounds=3", "rollout.ahead=1", "checkpoint.interval=2", *FAST]  # fmt: skip


@pytest.mark.timeout(900)
def test_dynamic_sampling_trains_on_signal_and_resumes_the_same_groups(tmp_path):
    full = tmp_path / "full"
    rc, out = train(full, "--steps", "4", *DS)
    assert rc == 0, out[-3000:]
    r = rows(full)
    assert [x["step"] for x in r] == [1, 2, 3, 4]
    for x in r:
        assert x["ds_generated"] == 6 * x["ds_rounds"]  # ceil(1.5 * 4) prompts a round
        assert 1 <= x["ds_rounds"] <= 3
        assert x["ds_fill"] == min(x["ds_signal"], 4) / 4
        # only zero-variance groups are masked, and only the ones a short step made up with
        assert x["masked_frac"] == pytest.approx(1 - x["ds_fill"])
        if x["ds_fill"] < 1:
            assert x["ds_rounds"] == 3 and f"step {x['step']}: dynamic sampling filled" in out
        else:
            assert f"step {x['step']}: dynamic sampling" not in out
    part = tmp_path / "part"
    stopped_copy(full, part, 2)
    rc, out = train(part, "--steps", "4", "--resume", *DS)
    assert rc == 0, out[-3000:]
    b = rows(part)
    assert_same_rows(r, b)
    assert [[x[k] for k in DS_KEYS] for x in b] == [[x[k] for k in DS_KEYS] for x in r]
