"""``bench reproduce``'s analysis (the command: ``bench/reproduce/run.py``, whose docstring
says how a verdict is decided): pure functions of the reward curves, no process, no file --
per-seed figures, their mean and spread over seeds, the verdict of one comparison and of a
claim."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import mpmath

from megatron_grpo.bench.common import trailing_mean
from megatron_grpo.bench.reproduce.claims import Claim

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"


def steps_to_threshold(xs: Sequence[float], threshold: float, w: int) -> int | None:
    """First step (1-based) whose trailing ``w``-mean reaches ``threshold``; None if never."""
    for i, m in enumerate(trailing_mean(xs, w)):
        if m >= threshold:
            return i + 1
    return None


def mean_std(xs: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and sample std (n - 1); std is None below two values, both None for none."""
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def seed_figures(rewards: Sequence[float], window: int, threshold: float) -> dict[str, Any]:
    w = min(window, len(rewards))
    return {
        "final": sum(rewards[-w:]) / w,
        "auc": sum(rewards) / len(rewards),
        "steps_to_threshold": steps_to_threshold(rewards, threshold, w),
    }


def summarize_variant(
    curves: Mapping[int, Sequence[float]],
    walls: Mapping[int, float],
    window: int,
    threshold: float,
    syncs: Mapping[int, int] | None = None,
    vs: Mapping[int, int] | None = None,
) -> dict[str, Any]:
    """Per-seed figures and their mean/std over seeds; ``curves``: seed -> reward per step;
    ``syncs``/``vs``: seed -> syncs made / fixed v used, when recorded."""
    per_seed = {s: seed_figures(c, window, threshold) for s, c in sorted(curves.items())}
    out: dict[str, Any] = {"seeds": sorted(curves), "per_seed": per_seed}
    for key in ("final", "auc"):
        out[f"{key}_mean"], out[f"{key}_std"] = mean_std([f[key] for f in per_seed.values()])
    hit = [f["steps_to_threshold"] for f in per_seed.values() if f["steps_to_threshold"]]
    out["reached"] = len(hit)
    out["steps_to_threshold_mean"] = mean_std(hit)[0]
    out["wall_s_mean"] = mean_std(list(walls.values()))[0]
    if syncs:
        out["syncs_mean"], out["syncs_std"] = mean_std([float(x) for x in syncs.values()])
        out["syncs_per_seed"] = dict(syncs)
    if vs:
        out["v_per_seed"] = dict(vs)
    return out


def t975(df: float) -> float:
    """Student's t two-sided 95% quantile ``t_{0.975}(df)``, df rounded down (conservative),
    exact to double precision for every df.

    ``P(|T| <= t) = 1 - I_{df/(df+t^2)}(df/2, 1/2)`` (Abramowitz & Stegun 26.5.27), written
    as ``I_{t^2/(df+t^2)}(1/2, df/2)`` (``I_x(a, b) = 1 - I_{1-x}(b, a)``), whose series
    mpmath sums at any df (the first form's stops converging near df = 1e5), and solved for
    0.95 by bisection at 30 digits (t_{0.975} falls from 12.71 at df = 1 to 1.95996 as df
    grows: the bracket [1, 13] holds it)."""
    k = mpmath.mpf(max(1, int(df)))
    with mpmath.workdps(30):
        level = mpmath.mpf("0.95")

        def coverage(t):
            return mpmath.betainc(0.5, k / 2, 0, t * t / (k + t * t), regularized=True) - level

        return float(mpmath.findroot(coverage, (mpmath.mpf(1), mpmath.mpf(13)), solver="bisect"))


def judge(
    kind: str,
    a: Sequence[float],
    b: Sequence[float],
    margin: float,
    z: float | None = None,
    paired: bool = False,
) -> tuple[str, str, dict[str, float]]:
    """Verdict of one comparison from per-seed values of a and b (module docstring).

    ``paired``: ``a[i]`` and ``b[i]`` come from the same seed, so the difference's standard
    error is that of the per-seed differences (what the seed does to both cancels), with
    n - 1 degrees of freedom; otherwise Welch's ``sqrt(sd_a^2/n_a + sd_b^2/n_b)`` with the
    Welch-Satterthwaite degrees of freedom. ``z``: the interval's half-width in standard
    errors; None = Student's t 95% quantile for those degrees of freedom."""
    if len(a) < 2 or len(b) < 2:
        return INCONCLUSIVE, f"{len(a)} and {len(b)} seeds: no spread to judge by", {}
    if paired:
        if len(a) != len(b):
            raise ValueError(
                f"paired comparison of {len(a)} and {len(b)} seeds: give both "
                "variants the same seeds, or paired=False."
            )
        diff, sd = mean_std([x - y for x, y in zip(a, b)])
        assert diff is not None and sd is not None  # len(a) >= 2: mean and std both defined
        se, df = sd / math.sqrt(len(a)), len(a) - 1.0
    else:
        (ma, sa), (mb, sb) = mean_std(a), mean_std(b)
        # len(a), len(b) >= 2 (checked above): every mean and std is defined
        assert ma is not None and sa is not None and mb is not None and sb is not None
        diff = ma - mb
        va, vb = sa**2 / len(a), sb**2 / len(b)
        se = math.sqrt(va + vb)
        den = va**2 / (len(a) - 1) + vb**2 / (len(b) - 1)
        df = (va + vb) ** 2 / den if den > 0 else len(a) + len(b) - 2.0
    k = t975(df) if z is None else z
    lo, hi = diff - k * se, diff + k * se
    fig = {"diff": diff, "se": se, "df": df, "k": k, "lo": lo, "hi": hi, "paired": paired}
    how = f"{'paired' if paired else 'Welch'}, {k:.3g} s.e."
    interval = f"diff {diff:+.3f}, interval [{lo:+.3f}, {hi:+.3f}] ({how})"
    inside = -margin <= lo and hi <= margin
    if kind == "equivalent":
        if inside:
            return REPRODUCED, f"{interval} lies within +-{margin:g}", fig
        if lo > margin or hi < -margin:
            return NOT_REPRODUCED, f"{interval} lies outside +-{margin:g}", fig
        return INCONCLUSIVE, f"{interval} crosses +-{margin:g}: more seeds or steps", fig
    if kind == "better":
        if lo > 0:
            return REPRODUCED, f"{interval} lies above 0", fig
        if hi < 0:
            return NOT_REPRODUCED, f"{interval} lies below 0: the opposite holds", fig
        if inside:
            return NOT_REPRODUCED, f"{interval} lies within +-{margin:g}: no effect", fig
        return INCONCLUSIVE, f"{interval} contains 0: more seeds or steps", fig
    raise ValueError(f"comparison kind {kind!r}: use 'better' or 'equivalent'.")


def combine(verdicts: Sequence[str]) -> str:
    """All reproduced -> reproduced; any not reproduced -> not reproduced; else inconclusive."""
    if verdicts and all(v == REPRODUCED for v in verdicts):
        return REPRODUCED
    if any(v == NOT_REPRODUCED for v in verdicts):
        return NOT_REPRODUCED
    return INCONCLUSIVE


def analyze_claim(
    claim: Claim,
    curves: Mapping[str, Mapping[int, Sequence[float]]],
    walls: Mapping[str, Mapping[int, float]],
    window: int,
    margin: float,
    z: float | None = None,
    syncs: Mapping[str, Mapping[int, int]] | None = None,
    vs: Mapping[str, Mapping[int, int]] | None = None,
) -> dict[str, Any]:
    """Summaries, comparisons and the verdict of one claim; ``curves[variant][seed]``
    (``syncs``, ``vs``: the same nesting, optional)."""
    syncs, vs = syncs or {}, vs or {}
    variants = {
        var.name: summarize_variant(curves[var.name], walls.get(var.name, {}), window,
                                    claim.threshold, syncs.get(var.name), vs.get(var.name))
        for var in claim.variants
    }  # fmt: skip
    comps = []
    for c in claim.comparisons:
        va, vb = variants[c.a]["per_seed"], variants[c.b]["per_seed"]
        paired = list(va) == list(vb)  # seed s of both variants: same start, same prompts
        verdict, reason, fig = judge(
            c.kind, [f[c.metric] for f in va.values()], [f[c.metric] for f in vb.values()],
            margin, z, paired,
        )  # fmt: skip
        comps.append({**asdict(c), "verdict": verdict, "reason": reason, **fig})
    return {
        "id": claim.id, "title": claim.title, "source": claim.source, "task": list(claim.task),
        "threshold": claim.threshold, "window": window, "margin": margin, "z": z,
        "variants": variants, "comparisons": comps,
        "verdict": combine([c["verdict"] for c in comps]),
    }  # fmt: skip
