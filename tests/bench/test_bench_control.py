"""``megatron-grpo bench control`` (megatron_grpo/bench/control/): both channels measured
between two spawned processes, the figures printed and written; no timing is asserted."""

from __future__ import annotations

import json

import pytest

from megatron_grpo.cli.main import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--channels", "store,tcp"], "--channels 'tcp': expected some of store,zmq"),
        (["--repeats", "0"], "--repeats 0, --samples 64, --tokens 256: each must be at least 1"),
    ],
)
def test_bench_control_rejects_bad_arguments(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "control", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_control_prints_and_writes_both_channels(tmp_path, capsys) -> None:
    out = tmp_path / "control.json"
    argv = ["--repeats", "3", "--samples", "2", "--tokens", "8", "--json", str(out)]
    assert main(["bench", "control", *argv]) == 0
    table = capsys.readouterr().out
    assert "channel  command" in table and "median ms" in table and "p90 ms" in table
    res = json.loads(out.read_text())
    got = [(r["channel"], r["command"], r["n"]) for r in res["rows"]]
    assert got == [(c, m, 3) for c in ("store", "zmq")
                   for m in ("update -> reply", "generate -> samples")]  # fmt: skip
    for r in res["rows"]:
        assert 0 < r["median_ms"] <= r["p90_ms"], r
        assert f"{r['median_ms']:.3f}" in table
