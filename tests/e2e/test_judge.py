"""reward.name=judge:HF_DIR end to end: the run starts the judge's vLLM engine in a process
of its own, scores every response through it, and stops it with the run."""

from __future__ import annotations

import pytest

from tests.helpers.runs import FAST, rows, train

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
def test_a_judge_model_scores_the_run_and_stops_with_it(tmp_path):
    from megatron_grpo.models.tiny import build_hf_model

    judge = build_hf_model(tmp_path / "judge", "tiny", seed=5)
    run = tmp_path / "run"
    rc, out = train(run, "--steps", "2", f"reward.name=judge:{judge}",
                    "reward.judge_max_model_len=256", *FAST)  # fmt: skip
    assert rc == 0, out[-3000:]
    assert "judge " in out and " up in " in out
    r = rows(run)
    assert [x["step"] for x in r] == [1, 2]
    for x in r:
        assert x["errors"] == 0 and x["timeouts"] == 0
        # the expected value of the judge's yes/no: strictly between the choices' rewards
        assert 0.0 < x["reward_mean"] < 1.0
    log = (run / "judge" / "rank0" / "judge.log").read_text()
    assert "listening on port" in log and "judge stopping" in log
