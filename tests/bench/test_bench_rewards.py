"""``megatron-grpo bench rewards`` (megatron_grpo/bench/rewards/): a step's rewards
in-process and through a loopback reward server, the figures printed and written; no
timing is asserted."""

from __future__ import annotations

import json

import pytest

from megatron_grpo.bench.rewards.run import gsm8k_like
from megatron_grpo.cli.main import main
from megatron_grpo.rewards.gsm8k import gsm8k_strict


def test_bench_rewards_rejects_bad_arguments(capsys) -> None:
    for argv, line in ((["--concurrency", "0"], "--concurrency 0 must be >= 1"),
                       (["--reward", "nosuch"], "--reward nosuch is not one of")):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            main(["bench", "rewards", *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert line in err and len(err.strip().splitlines()) == 1


def test_gsm8k_like_batch_is_half_right_and_carries_rows() -> None:
    prompts, responses, answers, rows = gsm8k_like(200)
    right = sum(gsm8k_strict(p, r, a) for p, r, a in zip(prompts, responses, answers))
    assert 60 < right < 140  # about half, so equal rewards on both sides mean something
    assert [r["id"] for r in rows] == list(range(200)) and all("solution" in r for r in rows)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_rewards_prints_and_writes_both_sides(tmp_path, capsys) -> None:
    out = tmp_path / "rewards.json"
    argv = ["--items", "24", "--concurrency", "4", "--batch-size", "5", "--repeats", "1",
            "--json", str(out)]  # fmt: skip
    assert main(["bench", "rewards", *argv]) == 0
    table = capsys.readouterr().out
    assert "remote / in-process" in table and "rewards identical: yes" in table
    res = json.loads(out.read_text())
    assert res["identical"] is True and res["remote"]["requests"] == 5
    assert res["ratio"] == pytest.approx(res["remote"]["seconds"] / res["in_process"]["seconds"])
