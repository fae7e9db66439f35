"""The projection's algebra (bench/projection/model.py): calibration, ratios, bytes. No timings."""

from __future__ import annotations

import math

import pytest

from megatron_grpo.bench.projection.model import (
    PAPER_IT_S,
    Assumptions,
    calibrate,
    calibrate_from_throughput,
    step_time,
    sync_s_for_ratio,
    throughput_ratio,
)


def test_calibration_reproduces_the_papers_throughputs_exactly():
    t_other, s = calibrate(PAPER_IT_S[1], 1, PAPER_IT_S[10], 10)
    assert 1 / step_time(t_other, s, 1) == pytest.approx(0.02828, rel=1e-12)
    assert 1 / step_time(t_other, s, 10) == pytest.approx(0.03828, rel=1e-12)
    # Hand-derived: S = (1/0.02828 - 1/0.03828) / 0.9, T_other = 1/0.02828 - S.
    s_hand = (1 / 0.02828 - 1 / 0.03828) / 0.9
    assert s == pytest.approx(s_hand, rel=1e-12)
    assert s == pytest.approx(10.264, abs=1e-3)
    assert t_other == pytest.approx(1 / 0.02828 - s_hand, rel=1e-12)
    assert throughput_ratio(t_other, s, 10) == pytest.approx(0.03828 / 0.02828, rel=1e-12)


def test_calibration_is_symmetric_in_its_two_points():
    assert calibrate(0.03828, 10, 0.02828, 1) == pytest.approx(calibrate(0.02828, 1, 0.03828, 10))


@pytest.mark.parametrize(
    "args, match",
    [((0.03, 2, 0.04, 2), "v_a == v_b"), ((0.04, 1, 0.03, 10), "S="), ((0, 1, 0.03, 10), "> 0")],
)
def test_calibration_refuses_singular_or_unphysical_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        calibrate(*args)


def test_ratio_is_one_without_sync_cost_and_monotone_in_v():
    assert all(throughput_ratio(25.0, 0.0, v) == 1.0 for v in (1, 2, 5, 10, 20))
    for s in (0.01, 0.5, 10.0):
        r = [throughput_ratio(25.0, s, v) for v in (1, 2, 5, 10, 20, 100)]
        assert r[0] == 1.0
        assert all(b > a for a, b in zip(r, r[1:]))
        assert r[-1] < (25.0 + s) / 25.0  # bounded by removing the sync entirely


def test_sync_cost_for_a_ratio_inverts_the_ratio():
    for ratio in (1.01, 1.1, 1.35):
        s = sync_s_for_ratio(25.0, ratio, 10)
        assert throughput_ratio(25.0, s, 10) == pytest.approx(ratio, rel=1e-12)
    with pytest.raises(ValueError, match="unreachable"):
        sync_s_for_ratio(25.0, 10.0, 10)


def test_step_time_refuses_v_below_one():
    with pytest.raises(ValueError, match="v=0"):
        step_time(1.0, 1.0, 0)


def test_check_on_a_measured_throughput_result():
    res = {"runs": [
        {"v": 1, "step_time_mean_s": 3.0, "sync_amortized_s": 1.0, "sync_time_mean_s": 1.0,
         "steps_per_s_ratio": 1.0},
        {"v": 2, "step_time_mean_s": 2.5, "sync_amortized_s": 0.5, "sync_time_mean_s": 1.0,
         "steps_per_s_ratio": 1.2},
    ]}  # fmt: skip
    c = calibrate_from_throughput(res)
    assert c["t_other_s"] == 2.0 and c["sync_s"] == 1.0
    assert c["rows"][1]["predicted_ratio"] == pytest.approx(3.0 / 2.5)


@pytest.mark.timeout(300)
def test_plan_bytes_of_the_7b_layouts():
    from megatron_grpo.bench.projection.model import plan_bytes, project

    b = plan_bytes(Assumptions())
    # bf16 Qwen2.5-7B (untied lm_head): 7.615e9 params -> 15.23 GB per copy.
    assert b.model_bytes == pytest.approx(15.23e9, rel=2e-3)
    # Two engines of TP=4: every vLLM rank receives its shard once -> two copies in all.
    assert b.direct_total == pytest.approx(2 * b.model_bytes, rel=1e-3)
    # TP1 x DP8: every trainer rank holds the whole model; all copies are in-process.
    assert b.direct_cross == 0 and b.direct_in_process == b.direct_total
    # Baseline: the full model to each of 8 vLLM ranks (7 over the wire, 1 in-process).
    assert b.baseline_broadcast_wire == 7 * b.model_bytes
    assert b.baseline_total == 8 * b.model_bytes
    tp2 = plan_bytes(Assumptions(trainer_tp=2))
    assert tp2.direct_total == pytest.approx(b.direct_total, rel=1e-3)
    assert tp2.direct_cross > 0
    assert tp2.baseline_gather_into_root == pytest.approx(b.model_bytes / 2, rel=1e-6)
    p = project(layouts=((1, 1),))
    paper = p["scenarios"][0]
    assert paper["ratios"][10] == pytest.approx(0.03828 / 0.02828, rel=1e-12)
    for s in p["scenarios"]:
        rs = [s["ratios"][v] for v in p["vs"]]
        assert rs[0] == 1.0 and all(b2 >= a2 for a2, b2 in zip(rs, rs[1:]))
    assert math.isclose(p["calibration"]["check_it_s"][1], 0.02828, rel_tol=1e-12)


# ------------------------------------------------------------------------------ rollout.ahead
def test_window_time_matches_the_hand_derived_limits():
    from megatron_grpo.bench.projection.window_schedule import window_time

    r, t, s, v = 2.0, 3.0, 5.0, 4
    assert window_time(r, t, s, v, 0, "disaggregated") == v * (r + t) + s  # serial
    assert window_time(r, t, s, v, 0, "colocated") == v * (r + t) + s
    assert window_time(r, t, s, v, v - 1, "disaggregated") == r + v * t + s  # trainer-bound
    assert window_time(3.0, 2.0, s, v, v - 1, "disaggregated") == v * 3.0 + 2.0 + s  # engines
    # one call of v steps: f*R + (1-f)*R*v, then the trainer
    assert window_time(r, t, s, v, v - 1, "colocated", 0.25) == r * (0.25 + 0.75 * v) + v * t + s
    # ahead=1: chunks (1,2) and (3,4), each launched when the trainer asks for its first step
    assert window_time(r, t, s, v, 1, "disaggregated") == 2 * (r + 2 * t) + s
    with pytest.raises(ValueError, match="ahead >= 0"):
        window_time(r, t, s, v, -1, "colocated")


def test_seven_b_prediction_uses_the_paper_calibration_and_gains_only_for_v_above_1():
    from megatron_grpo.bench.projection.model import seven_b_disaggregated

    p = seven_b_disaggregated(vs=(1, 4))
    assert p["rollout_s"] + p["train_s"] == pytest.approx(1 / 0.02828 - p["sync_s"])
    v1, v4 = p["rows"]
    assert v1["speedup"] == pytest.approx(1.0)
    r, t, s = p["rollout_s"], p["train_s"], p["sync_s"]
    assert v4["ahead_step_s"] == pytest.approx((r + 4 * t + s) / 4)
    assert v4["serial_step_s"] == pytest.approx(r + t + s / 4)


def test_qwen3_30b_a3b_sync_bytes_are_its_hand_counted_parameters():
    """``bench project --moe`` (bench/projection/moe.py): the parameter count of Qwen3-30B-A3B
    counted by hand, and the bytes of one sync into a vLLM TP=8 engine with vLLM's own expert
    parallelism: every parameter once, plus what vLLM holds on every rank (router, norms, and
    at TP=8 > 4 KV heads each KV head twice); all of it in-process, since vLLM EP rank r
    holds the experts trainer EP rank r holds."""
    from megatron_grpo.bench.projection.moe import MoESyncAssumptions, moe_sync_projection
    from megatron_grpo.bench.projection.table import format_moe_sync

    h, layers, experts, width, heads, kv_heads, hd, vocab = 2048, 48, 128, 768, 32, 4, 128, 151936
    attention = 2 * h * heads * hd + 2 * h * kv_heads * hd + 2 * hd  # q, o; k, v; q/k norm
    moe = experts * 3 * width * h + experts * h  # gate, up, down of each expert; the router
    params = 2 * vocab * h + layers * (attention + moe + 2 * h) + h  # untied; norms
    assert params == 30_532_122_624

    p = moe_sync_projection(MoESyncAssumptions(rollouts=((8, True),)))
    assert p["parameters"] == params and p["model_bytes"] == 2 * params
    [row] = p["rows"]
    replicated = layers * (experts * h + 2 * h + 2 * hd) + h  # on each of the 8 vLLM ranks
    kv_twice = layers * 2 * (8 - kv_heads) * hd * h  # each rank one KV head of 4
    assert row["bytes_per_sync"] == 2 * (params + 7 * replicated + kv_twice)
    assert row["in_process"] == row["bytes_per_sync"] and row["cross_process"] == 0
    table = format_moe_sync(p)
    assert "TP=8 EP" in table and "0.5-1.5 s" in table
