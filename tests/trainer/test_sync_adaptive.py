"""Adaptive sync interval (issue 25): the drift estimator, the rule, the schedule and its
window for rollout.ahead, the config checks. The end-to-end runs (every rank decides the
same, a resumed run decides the same) are in tests/e2e/test_sync_adaptive_runs.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_grpo.algorithms.drift import adaptive_sync_due, drift_from_sums, k3_drift_sums
from megatron_grpo.config import ConfigError, load_config
from megatron_grpo.metrics.summary import format_summary, summarize
from megatron_grpo.rollout.ahead import WindowBuffer
from megatron_grpo.trainer.sync_schedule import SyncSchedule

ln = math.log


# ------------------------------------------------------------------------------ estimator
def test_k3_drift_golden_numbers():
    # One sequence, three response tokens and one prompt token (mask 0) whose huge log-ratio
    # must not count. log(pi/alpha) = [ln 2, 0, -ln 2] -> k3 = (rho - 1) - log rho:
    #   rho = 2:   1 - ln 2   = 0.306853
    #   rho = 1:   0
    #   rho = 1/2: -1/2 + ln 2 = 0.193147
    # sum = 1/2 exactly, over 3 tokens: drift = 1/6.
    logp = torch.tensor([[5.0, ln(2) - 1.0, -1.0, -ln(2) - 1.0]])
    alpha = torch.tensor([[0.0, -1.0, -1.0, -1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    sums = k3_drift_sums(logp, alpha, mask)
    assert sums.tolist() == pytest.approx([0.5, 3.0], abs=1e-7)
    assert drift_from_sums(sums) == pytest.approx(1 / 6, abs=1e-7)
    # Identical policies: no drift; no token counted: 0, not NaN.
    assert drift_from_sums(k3_drift_sums(alpha, alpha, mask)) == 0.0
    assert drift_from_sums(k3_drift_sums(logp, alpha, torch.zeros_like(mask))) == 0.0


def test_k3_drift_is_the_kl_of_alpha_from_pi_computed_directly():
    # A vocabulary of 4 and one decoding position. Weighting every possible token y by
    # alpha(y) (the mask is a weight) gives the estimator's expectation under y ~ alpha,
    # which must be the KL(alpha || pi) computed from the two distributions directly.
    # float64 throughout: the estimator sums in float64, and a float32 reference carries
    # ~1e-6 relative error of its own (it failed rel=1e-6 on this machine's CPU kernels)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        alpha = torch.softmax(torch.randn(4, generator=gen, dtype=torch.float64), 0)
        pi = torch.softmax(torch.randn(4, generator=gen, dtype=torch.float64), 0)
        direct = float((alpha * (alpha.log() - pi.log())).sum())
        sums = k3_drift_sums(pi.log()[None], alpha.log()[None], alpha[None])
        assert drift_from_sums(sums) == pytest.approx(direct, rel=1e-6)
        assert direct > 0
    # Two positions (the second conditioned on the first, here independent): the token-mean
    # over both is the mean of the two positions' KLs; data-parallel shards add up.
    a2 = torch.softmax(torch.randn(2, 4, generator=gen, dtype=torch.float64), 1)
    p2 = torch.softmax(torch.randn(2, 4, generator=gen, dtype=torch.float64), 1)
    kl = (a2 * (a2.log() - p2.log())).sum(1)
    shards = [
        k3_drift_sums(p2.log()[i : i + 1], a2.log()[i : i + 1], a2[i : i + 1]) for i in (0, 1)
    ]
    assert drift_from_sums(shards[0] + shards[1]) == pytest.approx(float(kl.mean()), rel=1e-6)


def test_k3_drift_refuses_misaligned_shapes():
    with pytest.raises(ValueError, match=r"must be the same \[B, T\] shape"):
        k3_drift_sums(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 3))


# ------------------------------------------------------------------------------ the rule
@pytest.mark.parametrize(
    "drift, since, due",
    [
        (0.5, 1, False),  # drift far above max_drift, but before min_interval (2)
        (0.5, 2, True),  # from min_interval on, the drift decides
        (0.01, 2, False),  # at max_drift: not above it
        (0.0, 5, False),
        (0.0, 6, True),  # max_interval (6) reached: sync whatever the drift
        (0.0, 9, True),
    ],
)
def test_adaptive_rule_honours_min_and_max_interval(drift, since, due):
    assert adaptive_sync_due(drift, since, 0.01, 2, 6) is due


def _schedule(*overrides: str) -> SyncSchedule:
    return SyncSchedule.from_config(load_config(None, ["sync.mode=adaptive", *overrides]).sync)


def test_adaptive_schedule_over_a_run_keeps_every_interval_in_bounds():
    s = _schedule("sync.max_drift=0.01", "sync.min_interval=2", "sync.max_interval=4")
    # Drift grows with the steps since the sync, 3x faster in steps 9-16, none from 19 on.
    synced = []
    for step in range(1, 25):
        since = step - s.policy_version
        drift = 0.004 * since * (3 if 9 <= step <= 16 else 1) * (step < 19)
        if s.due(step, drift):
            s.synced(step)
            synced.append(step)
    intervals = [b - a for a, b in zip([0, *synced], synced)]
    assert all(2 <= i <= 4 for i in intervals), intervals
    # Slow drift: 3 steps (0.012 > 0.01); fast: 2 (the minimum; 0.024); none: 4 (the maximum).
    assert synced == [3, 6, 9, 11, 13, 15, 18, 22]
    assert intervals == [3, 3, 3, 2, 2, 2, 3, 4]
    with pytest.raises(ValueError, match="no measured drift"):
        s.due(25, None)


def test_fixed_schedule_is_every_v_whatever_the_drift():
    s = SyncSchedule.from_config(load_config(None, ["sync.interval=3"]).sync)
    assert [k for k in range(1, 13) if s.due(k, 1e9 if k % 2 else None)] == [3, 6, 9, 12]
    assert [s.window_end(k) for k in range(1, 8)] == [3, 3, 3, 6, 6, 6, 9]


def test_adaptive_window_reaches_min_interval_past_the_last_sync():
    s = _schedule("sync.min_interval=3", "sync.max_interval=8")
    assert [s.window_end(k) for k in (1, 2, 3, 4, 5)] == [3, 3, 3, 4, 5]
    s.synced(4)
    assert [s.window_end(k) for k in (5, 6, 7, 8)] == [7, 7, 7, 8]


def test_ahead_generates_no_step_past_the_adaptive_window():
    # rollout.ahead=5 with min_interval=2: the first window is steps 1-2; after that each
    # step is generated alone until the next sync (here after step 4), then 5-6 together.
    s = _schedule("sync.min_interval=2", "sync.max_interval=8")
    launched: list[list[int]] = []

    class Source:
        def next_batch(self, n):
            return [type("P", (), {"prompt_ids": [1]})()] * n

        def state_dict(self):
            return {}

    def launch(steps):
        launched.append([seed for _, seed in steps])
        return [lambda: ["sample"] for _ in steps]

    ahead = WindowBuffer(Source(), 1, 5, 99, 8, 0, launch, window_end=s.window_end)
    for step in range(1, 9):
        ahead.take(step)
        if step == 4:
            s.synced(4)
    assert [[seed // 7919 for seed in call] for call in launched] == [
        [1, 2], [3], [4], [5, 6], [7], [8]
    ]  # fmt: skip


# ------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["sync.mode=sometimes"], "sync.mode='sometimes' is not one of ['fixed', 'adaptive']"),
        (["sync.max_drift=0"], "sync.max_drift=0.0 must be > 0"),
        (["sync.min_interval=0"], "sync.min_interval=0 must be > 0"),
        (
            ["sync.min_interval=5", "sync.max_interval=4"],
            "sync.min_interval=5 exceeds sync.max_interval=4: the adaptive schedule syncs "
            "between them; raise sync.max_interval or lower sync.min_interval.",
        ),
        (
            ["sync.mode=adaptive", "rollout.sleep_level=2"],
            "but sync.mode=adaptive with sync.max_interval=16: set rollout.sleep_level=1",
        ),
    ],
)
def test_config_errors_name_the_values_and_the_fix(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert fragment in str(err.value)


def test_fixed_is_the_default_and_adaptive_keys_load():
    assert load_config().sync.mode == "fixed"
    cfg = load_config(None, ["sync.mode=adaptive", "sync.max_drift=0.05", "sync.min_interval=2",
                             "sync.max_interval=9"])  # fmt: skip
    s = cfg.sync
    assert (s.mode, s.max_drift, s.min_interval, s.max_interval, s.can_lag) == (
        "adaptive", 0.05, 2, 9, True)  # fmt: skip
    assert not load_config(None, ["sync.mode=adaptive", "sync.max_interval=1"]).sync.can_lag


# ------------------------------------------------------------------------------ summary
def test_summary_counts_the_syncs_made_and_the_mean_interval():
    synced = [False, False, True, False, True, False, False, False, True, False]
    rows = [{"step": k + 1, "synced": s, "time_step": 1.0, "time_sync": 0.5 if s else 0.0,
             "sync_bytes": 100 if s else 0, "reward_mean": 0.5, "drift": 0.001 * (k + 1)}
            for k, s in enumerate(synced)]  # fmt: skip
    s = summarize(rows, 4, "adaptive")
    assert (s["num_syncs"], s["sync_every_v_saving"]["avoided_syncs"]) == (3, 7)
    assert s["mean_sync_interval"] == pytest.approx(10 / 3)
    assert s["drift_max"] == pytest.approx(0.01)
    text = format_summary(s)
    assert "syncs (adaptive, mean interval 3.33 steps): 3" in text
    assert "adaptive sync vs every step: 7 syncs avoided" in text


# ------------------------------------------------------------------------------ plan, project
def test_plan_and_projection_take_an_observed_mean_interval():
    from megatron_grpo.bench.projection.model import project, throughput_ratio
    from megatron_grpo.dry_run import PlanError, build_launch_plan
    from megatron_grpo.models.shapes import resolve_spec

    spec, _ = resolve_spec("x", preset="Qwen2.5-7B")
    cfg_7b = Path(__file__).resolve().parents[2] / "configs" / "qwen2.5-7b-throughput.yaml"
    cfg = load_config(cfg_7b, ["sync.mode=adaptive"])
    fixed = build_launch_plan(load_config(cfg_7b), spec, nodes=1, gpus_per_node=8).to_json()
    per_sync = fixed["sync_bytes_per_sync"]
    assert fixed["sync_bytes_per_step"] == per_sync / 10  # the config's sync.interval
    assert build_launch_plan(cfg, spec, nodes=1, gpus_per_node=8).to_json()[
        "sync_bytes_per_step"] is None  # fmt: skip
    got = build_launch_plan(cfg, spec, nodes=1, gpus_per_node=8, mean_interval=2.5).to_json()
    assert got["sync_bytes_per_step"] == per_sync / 2.5
    with pytest.raises(PlanError, match=r"--mean-interval 0.5: an interval is >= 1 step"):
        build_launch_plan(cfg, spec, nodes=1, gpus_per_node=8, mean_interval=0.5)
    p = project(vs=(1, 10), mean_interval=3.5)
    assert p["vs"] == [1, 3.5, 10]
    t, s = p["calibration"]["t_other_s"], p["calibration"]["sync_s"]
    assert p["scenarios"][0]["ratios"][3.5] == pytest.approx(throughput_ratio(t, s, 3.5))
    assert (t + s) / (t + s / 3.5) == pytest.approx(throughput_ratio(t, s, 3.5))


# ------------------------------------------------------------------------------ agreement
def _drift_on_rank(rank: int, world_size: int, dp: int, init_file: str) -> float:
    """``trainer.logprobs.measure_drift`` on a gloo world: with dp=2 each rank holds its own half
    of a batch; with dp=1 (TP-like ranks) the same batch up to a rounding difference."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_grpo.trainer.logprobs import measure_drift

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)  # fmt: skip
    logp, alpha, mask = _batch()
    if dp == 2:
        rows = slice(2 * rank, 2 * rank + 2)
        logp, alpha, mask = logp[rows], alpha[rows], mask[rows]
    else:
        logp = logp + 1e-6 * rank  # ranks that should agree, but differ in the last digits
    ctx = SimpleNamespace(dp=dp, dp_group=dist.group.WORLD, world_size=world_size)
    try:
        return measure_drift(logp, alpha, mask, ctx)
    finally:
        dist.destroy_process_group()


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    alpha = -torch.rand(4, 6, generator=gen)
    logp = alpha + 0.3 * torch.randn(4, 6, generator=gen)
    mask = torch.zeros(4, 6)
    for i, n in enumerate((5, 2, 6, 1)):  # shards with different token counts
        mask[i, :n] = 1
    return logp, alpha, mask


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dp", [2, 1])
def test_every_rank_gets_the_same_drift_the_whole_batch_has(dp, tmp_path):
    from tests.dist_utils import run_distributed

    got = run_distributed(_drift_on_rank, 2, dp, str(tmp_path / "init"))
    assert got[0] == got[1]  # bit for bit: one agreed value, so one decision
    whole = drift_from_sums(k3_drift_sums(*_batch()))
    assert got[0] == pytest.approx(whole, rel=1e-5)


def test_drift_picture_only_for_runs_that_measured_drift(tmp_path):
    from megatron_grpo.metrics.plots import drift_axis_floor, write_plots

    rows = [{"step": k, "reward_mean": 0.5, "time_train": 0.1, "synced": k % 3 == 0, "interval_since_sync": 1 + (k - 1) % 3,
             "drift": [1e-14, 0.02, 0.05][(k - 1) % 3]} for k in range(1, 10)]  # fmt: skip
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    names = [p.name for p in write_plots(tmp_path / "a", rows, max_drift=0.03)]
    assert names == ["reward.png", "step_time.png", "drift.png"]
    assert (tmp_path / "a" / "drift.png").read_bytes()[:4] == b"\x89PNG"
    plain = [{k: v for k, v in r.items() if k != "drift"} for r in rows]
    assert [p.name for p in write_plots(tmp_path / "b", plain)] == ["reward.png", "step_time.png"]
    # The axis starts a decade below the smallest drift of moved weights, not at 1e-14.
    assert drift_axis_floor([1e-14, 0.02, 0.05], [True, False, False]) == pytest.approx(0.002)


# ------------------------------------------------------------------------------ bench claim 5
def test_claim_5_holds_the_syncs_equal_and_reports_them():
    from megatron_grpo.bench.reproduce.claims import CLAIMS, matched_sync_interval, plan_runs
    from megatron_grpo.bench.reproduce.report import intervals_since_sync, reproduce_markdown
    from megatron_grpo.bench.reproduce.stats import analyze_claim

    runs, run_of = plan_runs([5])
    by = {r.name: r for r in runs}
    matched = by[run_of[(5, "fixed, same syncs")]]
    assert matched.match == run_of[(5, "adaptive")]
    assert "sync.mode=adaptive" in by[run_of[(5, "adaptive")]].overrides
    assert [r.name for r in runs].index(matched.match) < [r.name for r in runs].index(matched.name)
    # 60 steps with 15 syncs -> v = 4 (15 syncs); 7 syncs -> v = 9 (6 syncs); none -> v = 60.
    assert (
        matched_sync_interval(60, 15),
        matched_sync_interval(60, 7),
        matched_sync_interval(60, 0),
        matched_sync_interval(3, 9),
    ) == (4, 9, 60, 1)
    assert intervals_since_sync([False, True, False, False, True]) == [1, 2, 1, 2, 3]
    curves = {"adaptive": {1: [0.2, 0.4], 2: [0.3, 0.5]},
              "fixed, same syncs": {1: [0.2, 0.4], 2: [0.3, 0.5]}, "v=1": {1: [0.2, 0.4], 2: [0.3, 0.5]}}  # fmt: skip
    syncs = {"adaptive": {1: 15, 2: 13}, "fixed, same syncs": {1: 15, 2: 15}, "v=1": {1: 60, 2: 60}}
    vs = {"adaptive": {1: None, 2: None}, "fixed, same syncs": {1: 4, 2: 5}, "v=1": {1: 1, 2: 1}}
    c = analyze_claim(CLAIMS[5], curves, {}, 2, 0.05, syncs=syncs, vs=vs)
    c["run_of"] = {}
    assert c["variants"]["adaptive"]["syncs_mean"] == 14.0
    md = reproduce_markdown({"args": {"steps": 60, "window": 2, "margin": 0.05, "z": None,
                                      "nproc": 1, "config": None, "overrides": []},
                             "seeds": [1, 2], "wall_s": 60.0, "machine": {}, "claims": {5: c}})  # fmt: skip
    assert "| adaptive | 14.000 +- 1.414 | - (adaptive) | 46.0 | - | - |" in md
    assert "| fixed, same syncs | 15.000 +- 0.000 | 4, 5 | 45.0 | - | - |" in md
