"""``megatron-grpo bench throughput``: argument checks and the analysis (fast), and the real
loop at v=1 and v=2 end to end (slow). No timing assertions: benchmarks print figures."""

from __future__ import annotations

import json

import pytest

from megatron_grpo.bench.throughput.run import ThroughputArgs, analyze_run, compare, train_command
from tests.helpers.bench import run_bench


def _row(step: int, synced: bool, **t) -> dict:
    times = dict(time_rollout=1.0, time_reward=0.1, time_logprobs=0.2, time_train=0.5)
    times.update(t)
    sync = 0.4 if synced else 0.0
    return dict(step=step, synced=synced, time_sync=sync, time_step=2.0 + sync,
                tokens_per_s=240.0 / (2.0 + sync), sync_bytes=8 if synced else 0,
                **times)  # fmt: skip


def test_measured_window_must_hold_whole_sync_periods():
    with pytest.raises(ValueError, match=r"--steps 11"):
        ThroughputArgs(vs=[1, 2, 5, 10], steps=10, warmup=1)
    with pytest.raises(ValueError, match="no measured step"):
        ThroughputArgs(vs=[1], steps=1, warmup=1)
    with pytest.raises(ValueError, match="sync.interval"):
        ThroughputArgs(vs=[1, 2], steps=3, overrides=["sync.interval=3"])
    with pytest.raises(ValueError, match=">= 1"):
        ThroughputArgs(vs=[0, 2], steps=3)
    ThroughputArgs(vs=[1, 2, 5, 10], steps=21, warmup=1)


def test_command_line_per_v(tmp_path):
    a = ThroughputArgs(vs=[1, 2], steps=3, overrides=["grpo.group_size=4"], nproc=2)
    cmd = train_command(a, 2, tmp_path / "v2")
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "--nproc-per-node=2" in cmd
    assert cmd[cmd.index("--sync-interval") + 1] == "2" and cmd[-1] == "grpo.group_size=4"
    assert "checkpoint.save_at_end=false" in cmd  # out of the last step's time
    one = train_command(ThroughputArgs(vs=[1, 2], steps=3), 1, tmp_path / "v1")
    assert "torch.distributed.run" not in one


def test_analysis_excludes_warmup_and_amortizes_the_sync():
    rows_v1 = [_row(k, True, time_rollout=9.0 if k == 1 else 1.0) for k in (1, 2, 3)]
    rows_v2 = [_row(k, k % 2 == 0, time_rollout=9.0 if k == 1 else 1.0) for k in (1, 2, 3)]
    r1, r2 = analyze_run(rows_v1, 1, 1), analyze_run(rows_v2, 2, 1)
    assert r1["measured_steps"] == 2 and r1["warmup_steps"] == 1
    assert r1["phase_mean_s"]["rollout"] == 1.0  # step 1's 9 s left out
    assert r1["measured_syncs"] == 2 and r2["measured_syncs"] == 1
    assert r1["sync_amortized_s"] == pytest.approx(0.4)
    assert r2["sync_amortized_s"] == pytest.approx(0.2)
    assert r1["phase_mean_s"]["other"] == pytest.approx(2.4 - 1.8 - 0.4)
    c = compare([r2, r1])
    assert c["reference_v"] == 1 and [r["v"] for r in c["runs"]] == [1, 2]
    assert c["runs"][1]["steps_per_s_ratio"] == pytest.approx(2.4 / 2.2)
    assert c["runs"][1]["sync_only_ratio"] == pytest.approx(2.4 / 2.2)
    assert c["runs"][1]["tokens_per_s_ratio"] == pytest.approx(2.4 / 2.2)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_throughput_end_to_end(tmp_path):
    out = tmp_path / "bench"
    js = tmp_path / "res.json"
    rc, text = run_bench("throughput", "--v", "1,2", "--steps", "3", "--warmup", "1",
                         "--out-dir", str(out), "--json", str(js), "model.warm_start_steps=5",
                         timeout=840)  # fmt: skip
    assert rc == 0, text[-4000:]
    res = json.loads(js.read_text())
    assert res["reference_v"] == 1
    runs = {r["v"]: r for r in res["runs"]}
    assert set(runs) == {1, 2}
    for r in runs.values():
        assert r["measured_steps"] == 2 and r["warmup_steps"] == 1
        assert r["steps_per_s"] > 0 and r["tokens_per_s"] > 0
        assert set(r["phase_mean_s"]) == {"rollout", "reward", "logprobs", "train", "sync", "other"}
        assert r["sync_time_mean_s"] > 0 and r["sync_bytes_mean"] > 0
    assert runs[1]["synced_steps"] == [1, 2, 3] and runs[2]["synced_steps"] == [2]
    assert runs[1]["measured_syncs"] == 2 * runs[2]["measured_syncs"]  # half as often
    assert runs[1]["steps_per_s_ratio"] == 1.0
    assert runs[2]["steps_per_s_ratio"] is not None and runs[2]["sync_only_ratio"] is not None
    # sync time per step: v=2 spreads its one sync over the steps v=1 syncs on (a figure of
    # two timed runs, so not compared here: bench throughput prints it side by side)
    assert runs[2]["sync_amortized_s"] > 0 and runs[1]["sync_amortized_s"] > 0
    for name in ("throughput_vs_v.png", "phase_breakdown.png", "throughput.md", "throughput.json"):
        assert (out / name).stat().st_size > 0
    assert "| v | ahead | steps/s |" in (out / "throughput.md").read_text()


def test_rounds_are_pooled_and_ratios_are_also_taken_round_by_round():
    from megatron_grpo.bench.throughput.run import analyze_rounds

    slow = [{**_row(k, True), "time_step": 4.8} for k in (1, 2, 3)]  # a round under load
    fast = [_row(k, True) for k in (1, 2, 3)]
    r1 = analyze_rounds([fast, slow], 1, 1)
    assert r1["rounds"] == 2 and r1["measured_steps"] == 4
    assert r1["steps_per_s_by_round"] == pytest.approx([1 / 2.4, 1 / 4.8])
    assert r1["steps_per_s"] == pytest.approx(4 / (2 * 2.4 + 2 * 4.8))
    r2 = analyze_rounds([[_row(k, k == 2) for k in (1, 2, 3)]] * 2, 2, 1)
    c = compare([r1, r2])
    # Round by round v=2 is 2.4/2.2 and 4.8/2.2 times faster: the median is their mean.
    assert c["runs"][1]["steps_per_s_ratio_median_of_rounds"] == pytest.approx(
        (2.4 / 2.2 + 4.8 / 2.2) / 2
    )


def test_ahead_pairs_carry_their_override_and_their_speedup_over_serial(tmp_path):
    a = ThroughputArgs(vs=[4], steps=5, aheads=[0, 3])
    assert train_command(a, 4, tmp_path / "x", 3)[-1] == "rollout.ahead=3"
    assert train_command(a, 4, tmp_path / "x", 0)[-1] == "rollout.ahead=0"
    assert not any("rollout.ahead" in x for x in train_command(ThroughputArgs(vs=[1]), 1, tmp_path))
    with pytest.raises(ValueError, match="--ahead"):
        ThroughputArgs(vs=[4], steps=5, aheads=[0, 0])
    with pytest.raises(ValueError, match="rollout.ahead"):
        ThroughputArgs(vs=[4], steps=5, overrides=["rollout.ahead=2"])
    from megatron_grpo.bench.throughput.run import analyze_rounds

    serial = analyze_rounds([[_row(k, k == 4) for k in (1, 2, 3, 4, 5)]], 4, 1)
    fast = [dict(_row(k, k == 4), time_step=1.2) for k in (1, 2, 3, 4, 5)]
    ahead = analyze_rounds([fast], 4, 1, ahead=3)
    c = compare([ahead, serial])
    assert [(r["v"], r["ahead"]) for r in c["runs"]] == [(4, 0), (4, 3)]
    assert c["runs"][0]["ahead_speedup"] == pytest.approx(1.0)
    assert c["runs"][1]["ahead_speedup"] == pytest.approx(serial["step_time_mean_s"] / 1.2)


def test_pinning_splits_the_cores_and_refuses_a_bad_list(monkeypatch):
    from megatron_grpo.bench.throughput.run import pin_env
    from megatron_grpo.rollout.server import pin_role

    assert pin_env([1, 0]) == {
        "MEGATRON_GRPO_TRAINER_CPUS": "0", "MEGATRON_GRPO_ROLLOUT_CPUS": "1",
    }  # fmt: skip
    assert pin_env([0]) == {}
    monkeypatch.setenv("MEGATRON_GRPO_TRAINER_CPUS", "x-1")
    with pytest.raises(RuntimeError, match="MEGATRON_GRPO_TRAINER_CPUS='x-1'"):
        pin_role(True, 1)


def test_ahead_prediction_comes_from_the_serial_runs_phases():
    from megatron_grpo.bench.throughput.run import analyze_rounds, predicted_ahead_speedup

    serial = analyze_rounds([[_row(k, k % 4 == 0) for k in range(1, 9)]], 4, 4)
    # R = 1.1, T = 0.7 + other 0.2 = 0.9, S = 0.4 (from _row); disaggregated window:
    # serial 4 * 2.0 + 0.4, ahead=3 R + 4 T + S (R > T: the engines are the pace: 4R + T + S)
    run = {"v": 4, "ahead": 3, "placement": "disaggregated"}
    assert predicted_ahead_speedup(serial, run) == pytest.approx(8.4 / (4 * 1.1 + 0.9 + 0.4))
    assert predicted_ahead_speedup(serial, dict(run, placement="colocated")) == pytest.approx(1)
