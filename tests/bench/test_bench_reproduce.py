"""``megatron-grpo bench reproduce``: the pure parts (claims plan, aggregation over seeds,
verdict rule, table) without processes, and one two-seed, four-step run end to end (slow).
It is a benchmark: nothing here asserts that a claim reproduces."""

from __future__ import annotations

import json
import math

import pytest

from megatron_grpo.bench.common import trailing_mean
from megatron_grpo.bench.reproduce.claims import CLAIMS, plan_runs
from megatron_grpo.bench.reproduce.run import ReproduceArgs, check_configs, estimate_s
from megatron_grpo.bench.reproduce.stats import (
    INCONCLUSIVE,
    NOT_REPRODUCED,
    REPRODUCED,
    analyze_claim,
    combine,
    judge,
    steps_to_threshold,
    summarize_variant,
    t975,
)
from tests.helpers.bench import run_bench


def test_shared_variants_run_once_and_every_run_differs_only_by_its_keys():
    runs, run_of = plan_runs([1, 2, 3, 4])
    # Claim 4's plain GRPO at v=4 is claim 1's v=4: one run serves both.
    assert run_of[(4, "GRPO")] == run_of[(1, "v=4")] == "c1-v-4"
    assert len(runs) == 3 + 2 + 4 + 2
    assert len({(r.v, r.overrides) for r in runs}) == len(runs)
    by = {r.name: r for r in runs}
    wide_is = by[run_of[(3, "clip 0.6/2.0 + IS")]]
    assert wide_is.v == 4 and {"grpo.loss.policy_loss=rec", "grpo.loss.rec_clip=one_side",
                               "grpo.loss.clip_eps_low=0.6", "grpo.loss.clip_eps_high=2.0",
                               "grpo.loss.rec_weight=is"} == set(wide_is.overrides)  # fmt: skip
    assert by[run_of[(2, "mask off")]].overrides[-1] == "grpo.zero_variance_mask=false"
    # --seeds 3 at the default steps stays under an hour on the cost model.
    assert estimate_s(3 * len(runs), ReproduceArgs().steps) < 3600


def test_args_are_checked_before_any_run():
    with pytest.raises(ValueError, match="--claims"):
        ReproduceArgs(claims=[9])
    with pytest.raises(ValueError, match="--seeds"):
        ReproduceArgs(seeds=0)
    with pytest.raises(ValueError, match="rollout.seed"):
        ReproduceArgs(overrides=["rollout.seed=3"])
    # Every claim's settings load; a bad key fails here, before the first run starts.
    assert check_configs(ReproduceArgs()) == 1  # the embedded defaults: one process
    with pytest.raises(ValueError, match="grpo.nosuch"):
        check_configs(ReproduceArgs(claims=[2], overrides=["grpo.nosuch=1"]))


def test_trailing_mean_and_steps_to_threshold():
    xs = [0.0, 0.2, 0.4, 0.6, 0.8]
    assert trailing_mean(xs, 2) == pytest.approx([0.0, 0.1, 0.3, 0.5, 0.7])
    assert steps_to_threshold(xs, 0.5, 2) == 4  # trailing means 0.3 at step 3, 0.5 at 4
    assert steps_to_threshold(xs, 0.9, 2) is None


def test_variant_summary_over_seeds():
    curves = {1: [0.0, 0.2, 0.4, 0.6], 2: [0.2, 0.2, 0.2, 0.2]}
    s = summarize_variant(curves, {1: 10.0, 2: 20.0}, window=2, threshold=0.45)
    assert s["per_seed"][1] == {"final": pytest.approx(0.5), "auc": pytest.approx(0.3),
                                "steps_to_threshold": 4}  # fmt: skip
    assert s["final_mean"] == pytest.approx(0.35)
    assert s["final_std"] == pytest.approx(((0.15**2) * 2) ** 0.5)  # sample std, n - 1
    assert s["reached"] == 1 and s["steps_to_threshold_mean"] == 4
    assert s["wall_s_mean"] == 15.0
    one = summarize_variant({1: [0.5]}, {}, window=10, threshold=0.1)
    assert one["final_std"] is None and one["wall_s_mean"] is None


def test_verdict_compares_the_interval_with_zero_and_the_margin():
    hi, lo = [0.80, 0.82, 0.78], [0.50, 0.52, 0.48]  # diff 0.30, se 0.0163
    assert judge("better", hi, lo, margin=0.05, z=2.0)[0] == REPRODUCED
    assert judge("better", lo, hi, margin=0.05, z=2.0)[0] == NOT_REPRODUCED
    same = [0.80, 0.81, 0.79]  # diff 0, se 0.0129
    v, why, fig = judge("equivalent", same, hi, margin=0.05, z=2.0)
    assert v == REPRODUCED and "within +-0.05" in why and fig["diff"] == pytest.approx(0.0)
    assert judge("equivalent", lo, hi, margin=0.05, z=2.0)[0] == NOT_REPRODUCED
    assert judge("better", same, hi, margin=0.05, z=2.0)[0] == NOT_REPRODUCED  # no effect
    noisy = [0.3, 0.9, 0.6]  # diff 0 +- 0.35: too noisy either way
    assert judge("equivalent", noisy, same, margin=0.05, z=2.0)[0] == INCONCLUSIVE
    assert judge("better", noisy, same, margin=0.05, z=2.0)[0] == INCONCLUSIVE
    assert judge("better", [0.9], [0.1], margin=0.05)[0] == INCONCLUSIVE  # one seed
    # Default: Student t for Welch's ~2.9 degrees of freedom, rounded down to 2 (4.303 s.e.):
    # same vs hi's interval +-0.056 now crosses the 0.05 margin.
    v, _, fig = judge("equivalent", same, hi, margin=0.05)
    assert v == INCONCLUSIVE and fig["k"] == pytest.approx(0.95 * (2 / 0.0975) ** 0.5, rel=1e-15)
    assert combine([REPRODUCED, REPRODUCED]) == REPRODUCED
    assert combine([REPRODUCED, INCONCLUSIVE]) == INCONCLUSIVE
    assert combine([INCONCLUSIVE, NOT_REPRODUCED]) == NOT_REPRODUCED


# Two-sided 95% quantiles of Student's t for df = 1..30, as printed to three decimals (e.g.
# NIST/SEMATECH e-Handbook of Statistical Methods, table 1.3.6.7.2).
T975_PRINTED = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201,
                2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074,
                2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def test_student_t_quantile_is_exact():
    # df = 1 is the Cauchy distribution: t = tan(pi (0.975 - 1/2)).
    assert t975(1) == pytest.approx(math.tan(0.475 * math.pi), rel=1e-15)
    # df = 2: P(T <= t) = 1/2 + t / (2 sqrt(2 + t^2)), so t = a sqrt(2 / (1 - a^2)), a = 0.95.
    assert t975(2) == pytest.approx(0.95 * math.sqrt(2 / (1 - 0.95**2)), rel=1e-15)
    assert [round(t975(df), 3) for df in range(1, 31)] == list(T975_PRINTED)
    # Past the printed table: t(31) is not the normal's 1.96; t tends to it as df grows
    # (z_{0.975} = 1.959963984540054, t - z ~ (z^3 + z) / (4 df)).
    assert round(t975(31), 4) == 2.0395
    z = 1.959963984540054
    assert t975(10**6) == pytest.approx(z + (z**3 + z) / 4e6, rel=1e-9)
    assert t975(2.9) == t975(2) and t975(0.5) == t975(1)  # df rounded down, at least 1


def test_paired_seeds_cancel_what_the_seed_does_to_both_variants():
    b = [0.40, 0.70, 0.55]  # a large seed-to-seed spread, shared by both variants
    a = [x + 0.01 + e for x, e in zip(b, (0.0, 0.002, -0.002))]
    welch = judge("equivalent", a, b, margin=0.05)
    paired = judge("equivalent", a, b, margin=0.05, paired=True)
    assert welch[0] == INCONCLUSIVE
    assert paired[0] == REPRODUCED and paired[2]["diff"] == pytest.approx(0.01)
    assert paired[2]["df"] == 2 and paired[2]["se"] == pytest.approx(0.002 / 3**0.5)
    with pytest.raises(ValueError, match="same seeds"):
        judge("better", a, b[:2], margin=0.05, paired=True)


def test_claim_table_and_figure(tmp_path):
    from megatron_grpo.bench.reproduce.report import plot_claim, reproduce_markdown

    claim = CLAIMS[4]
    up = {1: [0.2, 0.5, 0.8, 0.9], 2: [0.4, 0.5, 0.8, 0.9]}
    flat = {1: [0.2, 0.3, 0.3, 0.3], 2: [0.2, 0.4, 0.3, 0.3]}  # RED-Drop = GRPO: no effect
    curves = {"GRPO": flat, "RED-Weight": up, "RED-Drop": flat}
    res = analyze_claim(claim, curves, {}, window=2, margin=0.05)
    assert [c["verdict"] for c in res["comparisons"]] == [REPRODUCED, NOT_REPRODUCED]
    assert res["verdict"] == NOT_REPRODUCED
    full = {"args": dict(steps=4, window=2, margin=0.05, z=2.0, nproc=1, config=None,
                         overrides=[]),
            "seeds": [1, 2], "wall_s": 60.0, "machine": {"cpu": "x", "nproc": 2},
            "claims": {4: res}}  # fmt: skip
    md = reproduce_markdown(full)
    assert "| 4. RED-Weight and RED-Drop help off-policy (v = 4) | **not reproduced** |" in md
    assert "| RED-Weight | - | 0.850 +- 0.000 | 0.625 +- 0.035 | 3.0 (2/2) | - |" in md
    assert "| RED-Drop better than GRPO | final | not reproduced |" in md
    png = plot_claim(res, curves, tmp_path / "c4.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_bench_reproduce_end_to_end(tmp_path):
    out = tmp_path / "rep"
    rc, text = run_bench("reproduce", "--claims", "2", "--seeds", "2", "--steps", "2",
                         "--window", "2", "--out-dir", str(out), timeout=400)  # fmt: skip
    assert rc == 0, text[-4000:]
    assert "estimated wall time 4 x" in text.splitlines()[0]
    res = json.loads((out / "reproduce.json").read_text())
    c = res["claims"]["2"]
    runs = c["run_of"]
    assert set(runs) == {"mask on", "mask off"}
    for run in runs.values():
        assert set(res["curves"][run]) == {"1", "2"}
        assert all(len(x) == 2 for x in res["curves"][run].values())
    # Different seeds, different samples: the curves are real runs, not copies.
    on = res["curves"][runs["mask on"]]
    assert on["1"] != on["2"]
    assert c["verdict"] in ("reproduced", "not reproduced", "inconclusive")
    assert (out / "claim2.png").read_bytes()[:4] == b"\x89PNG"
    assert "### Claim 2:" in (out / "reproduce.md").read_text()


def test_report_from_json_reanalyzes_saved_curves(tmp_path):
    from megatron_grpo.bench.reproduce.run import report_from_json

    runs, run_of = plan_runs([4])
    curve = {"1": [0.2, 0.4, 0.6], "2": [0.3, 0.5, 0.7]}  # JSON keys: strings
    saved = {"args": {"claims": [4], "window": 2, "margin": 0.05, "z": None, "steps": 3,
                      "nproc": 1, "config": None, "overrides": []},
             "curves": {r.name: curve for r in runs},
             "walls": {r.name: {"1": 10.0, "2": 12.0} for r in runs}}  # fmt: skip
    (tmp_path / "curves.json").write_text(json.dumps(saved))
    res = report_from_json(tmp_path / "curves.json", tmp_path / "out")
    c = res["claims"][4]
    assert res["seeds"] == [1, 2] and res["wall_s"] == 66.0
    assert c["variants"]["GRPO"]["final_mean"] == pytest.approx((0.5 + 0.6) / 2)
    assert c["verdict"] == NOT_REPRODUCED  # identical curves: no effect
    assert all(k["paired"] for k in c["comparisons"])
    for name in ("claim4.png", "reproduce.md", "reproduce.json"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    del saved["curves"][run_of[(4, "RED-Drop")]]
    (tmp_path / "part.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="c4-RED-Drop"):
        report_from_json(tmp_path / "part.json", tmp_path / "out2")
