"""Metrics: schema, jsonl resume semantics, sinks, timer, summary numbers and plots."""

from __future__ import annotations

import io
import json
import math
import sys
import time
import types

import pytest

from megatron_grpo.config.schema import LoggingConfig
from megatron_grpo.metrics import (
    FIELD_NAMES,
    MetricsLogger,
    PhaseTimer,
    StepMetrics,
    read_metrics,
    summarize,
    summary,
    write_plots,
)

QUIET = LoggingConfig(tensorboard=False, wandb_project=None, progress=False, plots=False)


def _row(step: int, v: int = 4, **kw) -> dict:
    synced = step % v == 0
    base = dict(
        step=step,
        reward_mean=0.1 * step,
        reward_std=0.05,
        policy_version=(step - 1) // v * v,
        synced=synced,
        sync_bytes=1000 if synced else 0,
        time_rollout=1.0,
        time_reward=0.1,
        time_logprobs=0.2,
        time_train=0.5,
        time_sync=0.4 if synced else 0.0,
        time_step=1.8 + (0.4 if synced else 0.0),
    )
    base.update(kw)
    return StepMetrics.from_mapping(base).to_row()


def test_schema_has_required_fields_and_docs_table_matches():
    required = {
        "step", "reward_mean", "reward_std", "pass_rate", "synced", "policy_version", "lag",
        "sync_bytes", "time_rollout", "time_reward", "time_logprobs", "time_train", "time_sync",
        "time_step", "response_len_mean", "response_len_max", "clip_frac_low", "clip_frac_high",
        "kl", "entropy", "masked_frac", "tokens_per_s", "loss", "grad_norm", "lr", "skipped_nan",
    }  # fmt: skip
    assert required <= FIELD_NAMES
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    for name in FIELD_NAMES:
        assert f"| `{name}` |" in doc, f"docs/metrics.md has no row for {name}"


def test_step_metrics_lag_extra_and_scalars():
    torch = pytest.importorskip("torch")
    m = StepMetrics.from_mapping(
        {"step": 7, "policy_version": 4, "loss": torch.tensor(0.5), "my_stat": 3}
    )
    assert m.lag == 3 and m.extra == {"my_stat": 3}
    row = m.to_row()
    assert row["loss"] == 0.5 and row["my_stat"] == 3 and row["lag"] == 3
    assert StepMetrics(step=1, loss=float("nan")).to_row()["loss"] is None
    with pytest.raises(ValueError, match="collide"):
        StepMetrics(step=1, extra={"loss": 1.0})
    with pytest.raises(ValueError, match="'step'"):
        StepMetrics.from_mapping({"loss": 1.0})
    with pytest.raises(TypeError, match="not a scalar"):
        StepMetrics(step=1, extra={"obj": object()}).to_row()


def test_jsonl_flushed_each_step_and_resume_truncates(tmp_path):
    lg = MetricsLogger(tmp_path, QUIET, total_steps=10, rank=0)
    for s in range(1, 7):
        lg.log(_row(s))
        # Flushed: another reader sees the line before close (a crash loses nothing).
        assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == list(
            range(1, s + 1)
        )
    # Crash without close, mid-write of step 7: a torn last line.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "rew')
    lg2 = MetricsLogger(tmp_path, QUIET, total_steps=10, rank=0, resume_step=4)
    assert [r["step"] for r in lg2.rows] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="steps must increase"):
        lg2.log(_row(4))
    lg2.log(_row(5, reward_mean=9.0))
    lg2.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[-1]["reward_mean"] == 9.0
    assert rows[-1]["wall_s"] >= rows[3]["wall_s"]  # wall clock continues across resumes
    lg.close()
    # A fresh run in a used run_dir starts the file over.
    MetricsLogger(tmp_path, QUIET, total_steps=10, rank=0).close()
    assert read_metrics(tmp_path / "metrics.jsonl") == []


def test_malformed_middle_line_names_the_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(p)


def test_nonzero_rank_writes_nothing(tmp_path):
    lg = MetricsLogger(tmp_path / "r1", LoggingConfig(), total_steps=3, rank=1)
    assert lg.log(_row(1)) is None and lg.finish(sync_interval=2) == ""
    assert not (tmp_path / "r1").exists()


def test_tensorboard_progress_summary_and_plots(tmp_path):
    cfg = LoggingConfig(tensorboard=True, wandb_project=None, progress=True, plots=True)
    stream = io.StringIO()
    lg = MetricsLogger(tmp_path, cfg, total_steps=8, rank=0, stream=stream)
    for s in range(1, 9):
        lg.log(_row(s))
    text = lg.finish(sync_interval=4)
    assert "syncs (v=4): 2" in text and "= 1.158x" in text
    assert "policy v4 lag" in stream.getvalue() and "8/8" in stream.getvalue()
    bar = stream.getvalue().split("\r")[-1]  # one rate figure, the step time (issue 47)
    assert bar.count("s/step") == 1 and "step/s" not in bar and "2.20 s/step" in bar
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("time/sync")][3] == pytest.approx(0.4)
    for name in ("reward.png", "step_time.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "summary.json").read_text())["num_syncs"] == 2


def test_step_time_axis_leaves_out_a_slow_first_step():
    from megatron_grpo.metrics.plots import step_time_axis_top

    assert step_time_axis_top([17.0, 2.0, 1.5, 2.0]) == pytest.approx(2.5)
    assert step_time_axis_top([3.0, 2.0, 1.5]) is None  # not dominated: matplotlib's axis
    assert step_time_axis_top([17.0]) is None


def test_summary_numbers_by_hand():
    # 8 steps, v=4: syncs at 4 and 8 (0.4 s, 1000 B each). time_step 1.8 (+0.4 when synced).
    rows = [_row(s) for s in range(1, 9)]
    s = summarize(rows, sync_interval=4)
    assert s["num_syncs"] == 2 and s["sync_bytes_total"] == 2000
    assert s["sync_time_mean_s"] == pytest.approx(0.4)
    assert s["phase_time_mean_s"]["sync"] == pytest.approx(0.8 / 8)
    assert s["phase_time_mean_s"]["rollout"] == pytest.approx(1.0)
    # A short run compares its halves, never overlapping windows (issue 47 item 11).
    assert s["reward_window"] == 4
    assert s["reward_first"] == pytest.approx(0.25) and s["reward_last"] == pytest.approx(0.65)
    assert "first 4 steps 0.25 -> last 4 steps 0.65" in summary(rows, sync_interval=4)
    one = summary([_row(1)], sync_interval=4)
    assert "reward mean: 0.1 (too few steps to compare)" in one
    sv = s["sync_every_v_saving"]
    actual = 8 * 1.8 + 0.8  # 15.2 s
    assert sv["avoided_syncs"] == 6
    assert sv["saved_time_s"] == pytest.approx(2.4) and sv["saved_bytes"] == 6000
    assert sv["throughput_ratio"] == pytest.approx((actual + 2.4) / actual)
    assert sv["steps_per_s"] == pytest.approx(8 / actual)
    assert s["lag_max"] == 4 and s["lag_mean"] == pytest.approx(2.5)
    # First/last windows of 20 differ on a longer run.
    long = summarize([_row(s) for s in range(1, 51)], sync_interval=4)
    assert long["reward_first"] == pytest.approx(0.1 * 10.5)
    assert long["reward_last"] == pytest.approx(0.1 * 40.5)
    assert "no timed sync" in summary([_row(1, v=4)], sync_interval=4)
    assert summary([], 4) == "summary: no steps logged."
    with pytest.raises(ValueError, match="sync_interval=0"):
        summarize(rows, 0)


def test_plots_tolerate_missing_values(tmp_path):
    rows = [{"step": 1}, {"step": 2, "reward_mean": 0.5, "synced": True, "time_step": 1.0}]
    assert all(p.stat().st_size > 0 for p in write_plots(tmp_path, rows))


def test_phase_timer_sums_repeats_syncs_at_each_edge_and_keeps_time_on_error():
    calls = []
    t = PhaseTimer(sync=lambda: calls.append(1))
    with t.phase("rollout"):
        time.sleep(0.01)
    with t.phase("rollout"):
        pass
    with t.phase("train"):
        pass
    times = t.times()
    assert set(times) == {"time_rollout", "time_train"} and times["time_rollout"] >= 0.01
    assert len(calls) == 6
    with pytest.raises(RuntimeError, match="already being timed"), t.phase("x"), t.phase("x"):
        pass
    t.reset()
    assert t.times() == {} and t.elapsed("rollout") == 0.0
    with pytest.raises(ValueError), t.phase("train"):  # time still recorded on error
        raise ValueError
    assert t.elapsed("train") > 0 and not math.isnan(t.elapsed("train"))


def test_wandb_missing_gives_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = LoggingConfig(tensorboard=False, wandb_project="proj", progress=False, plots=False)
    with pytest.raises(ImportError, match="pip install wandb"):
        MetricsLogger(tmp_path, cfg, total_steps=3, rank=0)


def test_wandb_logs_and_resumes_same_run(tmp_path, monkeypatch):
    calls: list = []

    class Run:
        id = "abc123"
        summary: dict = {}

        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = LoggingConfig(tensorboard=False, wandb_project="proj", progress=False, plots=False)
    lg = MetricsLogger(tmp_path, cfg, total_steps=3, rank=0, run_config={"steps": 3})
    lg.log(_row(1))
    lg.finish(sync_interval=4)
    assert calls[0][0] == "init" and calls[0][1]["project"] == "proj" and calls[0][1]["id"] is None
    assert calls[1][1] == 1 and calls[1][2]["reward/reward_mean"] == pytest.approx(0.1)
    assert Run.summary["steps"] == 1 and calls[-1] == ("finish",)
    calls.clear()
    lg = MetricsLogger(tmp_path, cfg, total_steps=3, rank=0, resume_step=1)
    lg.log(_row(2))
    lg.close()
    assert calls[0][1]["id"] == "abc123" and calls[0][1]["resume"] == "allow"
