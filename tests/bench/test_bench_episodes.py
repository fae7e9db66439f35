"""``megatron-grpo bench episodes`` (megatron_grpo/bench/episodes/): one engine, one-turn and
multi-turn generation of the same model tokens, the figures printed and written; no timing
is asserted."""

from __future__ import annotations

import json

import pytest

from megatron_grpo.cli.main import main


def test_bench_episodes_rejects_bad_arguments(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "episodes", "--turns", "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--turns 0 must be >= 1" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_episodes_prints_and_writes_both_sides(tmp_path, capsys) -> None:
    out = tmp_path / "episodes.json"
    argv = ["--prompts", "2", "--samples", "2", "--turns", "3", "--turn-tokens", "4",
            "--repeats", "1", "--cache-dir", str(tmp_path), "--json", str(out)]  # fmt: skip
    assert main(["bench", "episodes", *argv]) == 0
    table = capsys.readouterr().out
    assert "multi-turn / one-turn" in table
    res = json.loads(out.read_text())
    one, multi = res["one_turn"], res["multi_turn"]
    assert one["turns_mean"] == 1.0 and multi["turns_mean"] == 3.0  # FixedReply never ends
    assert 0 < one["model_tokens"] <= 4 * 12 and 0 < multi["model_tokens"] <= 4 * 12
    assert res["ratio_tokens_per_s"] == pytest.approx(multi["tokens_per_s"] / one["tokens_per_s"])
