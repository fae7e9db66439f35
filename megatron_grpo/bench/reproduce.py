"""``megatron-grpo bench reproduce``: the source papers' claims, at tiny-model scale, with seeds.

Each claim (:data:`CLAIMS`) names variants of the training job that differ only in the keys
the claim is about, a set of comparisons between them, and a reward threshold. Every variant
runs once per seed (``seed``, ``rollout.seed`` and ``data.shuffle_seed`` all set to the
seed, so the random weights, the warm start, the prompt order and the samples all change
with it) through the same launcher as ``bench throughput`` (:func:`common.train_argv`,
:func:`common.run_logged`), and the runs are ordered round-robin: seed 1 of every
variant, then seed 2 of every variant, ..., so a change of machine load over the hours hits
every variant alike. A variant shared by two claims (claim 1's v=4 is claim 4's plain
GRPO) runs once.

The analysis is pure (no process, no file): per seed, the reward curve (``reward_mean`` of
each step's metrics.jsonl line), its final-window mean (the last ``window`` steps), its
mean over all steps (``auc``, a learning-speed figure) and the first step whose trailing
``window``-mean reaches the claim's threshold; per variant, mean and sample std over seeds.
:func:`judge` turns a comparison into a verdict (docs/reproduction.md, "How the verdict is
decided"):

- ``better`` (a beats b): the interval ``diff +- k * se`` (``diff`` = mean(a) - mean(b);
  ``se`` = the standard error of the per-seed differences a_s - b_s, since seed s of every
  variant starts from the same warm-started weights with the same prompt order and
  sampling seeds, or Welch's when the seed sets differ; ``k`` = Student's t 95% quantile
  for its degrees of freedom, or ``--z``) lies above 0 -> reproduced; below 0 -> not
  reproduced; inside ``+-margin`` -> not reproduced (no effect as large as the margin at
  this scale); otherwise inconclusive.
- ``equivalent`` (a matches b): the interval lies inside ``+-margin`` -> reproduced; wholly
  outside it -> not reproduced; otherwise inconclusive.

Fewer than two seeds give no spread: every comparison is inconclusive. A claim is
reproduced when all its comparisons are, not reproduced when any is not, else inconclusive.

Claim 5 (issue 25, ``sync.mode=adaptive``) has a variant whose v is not fixed in advance:
``Variant.match`` names the variant whose syncs set it, per seed, to
``round(steps / that run's syncs)`` (:func:`matched_v`), so fixed v and adaptive run at the
same mean number of syncs; the matched variant runs after its source in each round. Every
run's syncs, v and drift/synced columns are kept (``syncs``, ``vs``, ``sync_curves``) for
the sync table and the drift/interval figure of the report.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from megatron_grpo.bench.common import (
    config_nproc,
    loadavg,
    machine_info,
    run_logged,
    trailing_mean,
    train_argv,
)
from megatron_grpo.bench.report import write_reproduce_report
from megatron_grpo.config import load_config
from megatron_grpo.metrics.logger import read_metrics

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"

# ------------------------------------------------------------------------------ claims


@dataclass(frozen=True)
class Variant:
    name: str
    """Label in plots and tables."""
    v: int
    """Sync period (sync.interval)."""
    overrides: tuple[str, ...] = ()
    """key=value on top of the claim's task settings."""
    match: str | None = None
    """Another variant of the claim (listed before this one): this variant's v is, per seed,
    ``matched_v`` of that run's syncs (``v`` is then only a placeholder)."""


@dataclass(frozen=True)
class Comparison:
    kind: Literal["better", "equivalent"]
    a: str
    """Variant name whose metric is claimed better than / equal to b's."""
    b: str
    metric: Literal["final", "auc"] = "final"
    """``final``: mean reward of the last ``window`` steps; ``auc``: mean reward over all
    steps (higher = learned earlier)."""


@dataclass(frozen=True)
class Claim:
    id: int
    title: str
    source: str
    task: tuple[str, ...]
    """key=value shared by all variants of the claim (the task and its setting)."""
    variants: tuple[Variant, ...]
    comparisons: tuple[Comparison, ...]
    threshold: float
    """Reward the trailing window-mean must reach for "steps to threshold"."""


# The tiny default job (megatron_grpo/config/schema.py): synthetic:max after a 15-step warm
# start, G=8 x 8 prompts, lr 1e-3: it learns from ~0.35 to ~0.75 mean reward in 60 steps.
TASK_MAX: tuple[str, ...] = ()
# Claim 2 needs the failure mode the mask addresses: most groups with zero reward variance.
# A 5-step warm start leaves the model answering right ~3% of the time (about half the
# groups all-wrong); beta=0.1 is the paper's GSM8K KL weight, and on-policy (v=1) is where
# the paper reports the unstable run. See docs/reproduction.md, "Claim 2".
TASK_SPARSE: tuple[str, ...] = ("model.warm_start_steps=5", "grpo.kl_coef=0.1")
# Claim 3 through existing keys: REC's one-side clip mask reads grpo.clip_eps_low/high (the
# defaults are PPO's 0.2/0.2); rec_weight none = NoIS, is = the importance weight rho.
REC = ("grpo.policy_loss=rec", "grpo.rec_clip=one_side")
WIDE = ("grpo.clip_eps_low=0.6", "grpo.clip_eps_high=2.0")
# Claim 5: ratio_mode=exact gives every variant pi_k's log-probs, so fixed runs log the same
# drift column as adaptive ones at no extra forward pass (equal cost per step). On the tiny
# job the per-token drift after 1-3 updates spans ~1e-3..1e-1 (docs/reproduction.md, claim
# 5); max_drift=0.02 lands between, so the interval follows the drift within 1..8.
TASK_DRIFT: tuple[str, ...] = ("grpo.ratio_mode=exact",)
ADAPTIVE = ("sync.mode=adaptive", "sync.max_drift=0.02", "sync.min_interval=1",
            "sync.max_interval=8")  # fmt: skip

CLAIMS: dict[int, Claim] = {
    c.id: c
    for c in (
        Claim(
            1,
            "Off-policy v > 1 matches on-policy v = 1 in reward per step",
            "Mroueh et al., arXiv 2505.22257, Sec. 5 (v=10 equals v=1 on GSM8K, AIME24, MATH500)",
            TASK_MAX,
            (Variant("v=1", 1), Variant("v=4", 4), Variant("v=8", 8)),
            (Comparison("equivalent", "v=4", "v=1"), Comparison("equivalent", "v=8", "v=1")),
            threshold=0.6,
        ),
        Claim(
            2,
            "The zero-variance mask stabilises training (sparse success)",
            "Mroueh et al., arXiv 2505.22257 (on-policy GSM8K: unstable 45% -> stable 50%)",
            TASK_SPARSE,
            (
                Variant("mask on", 1, ("grpo.zero_variance_mask=true",)),
                Variant("mask off", 1, ("grpo.zero_variance_mask=false",)),
            ),
            (Comparison("better", "mask on", "mask off"),),
            threshold=0.3,
        ),
        Claim(
            3,
            "Clipping, not importance sampling, carries stability; wide clip (0.6, 2.0) learns "
            "faster than (0.2, 0.2)",
            "Yao et al., arXiv 2509.24203 (REC-OneSide, off-policy)",
            TASK_MAX,
            (
                Variant("clip 0.2/0.2", 4, (*REC, "grpo.rec_weight=none")),
                Variant("clip 0.6/2.0", 4, (*REC, *WIDE, "grpo.rec_weight=none")),
                Variant("clip 0.2/0.2 + IS", 4, (*REC, "grpo.rec_weight=is")),
                Variant("clip 0.6/2.0 + IS", 4, (*REC, *WIDE, "grpo.rec_weight=is")),
            ),
            (
                Comparison("better", "clip 0.6/2.0", "clip 0.2/0.2", "auc"),
                Comparison("better", "clip 0.6/2.0 + IS", "clip 0.2/0.2 + IS", "auc"),
                Comparison("equivalent", "clip 0.6/2.0 + IS", "clip 0.6/2.0"),
                Comparison("equivalent", "clip 0.2/0.2 + IS", "clip 0.2/0.2"),
            ),
            threshold=0.6,
        ),
        Claim(
            4,
            "RED-Weight and RED-Drop help off-policy (v = 4)",
            "Yao et al., arXiv 2509.24203 (RED-Drop, RED-Weight)",
            TASK_MAX,
            (
                Variant("GRPO", 4),
                Variant("RED-Weight", 4, ("grpo.advantage=red_weight",)),
                Variant("RED-Drop", 4, ("grpo.red_drop=true",)),
            ),
            (Comparison("better", "RED-Weight", "GRPO"), Comparison("better", "RED-Drop", "GRPO")),
            threshold=0.6,
        ),
        Claim(
            5,
            "Adaptive sync (drift-triggered) beats fixed v at the same number of syncs and "
            "matches v = 1",
            "issue 25; Mroueh et al., arXiv 2505.22257 (open problem: v is chosen empirically; "
            "the bound's TV(pi_k, alpha) term)",
            TASK_DRIFT,
            (
                Variant("adaptive", 4, ADAPTIVE),
                Variant("fixed, same syncs", 4, match="adaptive"),
                Variant("v=1", 1),
            ),
            (
                Comparison("better", "adaptive", "fixed, same syncs", "auc"),
                Comparison("equivalent", "adaptive", "v=1"),
            ),
            threshold=0.6,
        ),
    )
}

SEED_KEYS = ("seed", "rollout.seed", "data.shuffle_seed")
RESERVED_KEYS = ("steps", "sync.interval", "sync.mode", "run_dir", *SEED_KEYS)

# Cost model of one run, for the estimate printed at start: start-up (model build, warm
# start, Megatron, vLLM engine) + seconds per step of the tiny default job (one process,
# OMP_NUM_THREADS=1). Measured on the 2-core machine of docs/reproduction.md: a 60-step run
# took 45 s after boot (cold imports, 15 s engine start) and 20-27 s with warm caches;
# the constants round that up (60 steps -> 36 s), so the estimate is a ceiling.
START_S, STEP_S = 15.0, 0.35


def seed_overrides(seed: int) -> list[str]:
    return [f"{k}={seed}" for k in SEED_KEYS]


@dataclass(frozen=True)
class RunSpec:
    """One distinct training job (a claim variant; shared variants collapse into one)."""

    name: str
    v: int
    overrides: tuple[str, ...]
    match: str | None = None
    """Run name whose syncs set this run's v per seed (``Variant.match``)."""


def matched_v(steps: int, syncs: int) -> int:
    """The fixed v whose run of ``steps`` steps syncs about ``syncs`` times (at least 1)."""
    return max(1, round(steps / max(syncs, 1)))


def plan_runs(claims: Sequence[int]) -> tuple[list[RunSpec], dict[tuple[int, str], str]]:
    """The distinct runs the claims need, in claim order, and ``(claim, variant) -> run name``."""
    runs: dict[tuple[int, tuple[str, ...]], RunSpec] = {}
    of: dict[tuple[int, str], str] = {}
    for cid in claims:
        c = CLAIMS[cid]
        for var in c.variants:
            match = of[(cid, var.match)] if var.match else None
            key = (var.v, (*c.task, *var.overrides), match)
            if key not in runs:
                slug = re.sub(r"[^A-Za-z0-9]+", "-", var.name).strip("-")
                runs[key] = RunSpec(f"c{cid}-{slug}", var.v, key[1], match)
            of[(cid, var.name)] = runs[key].name
    return list(runs.values()), of


# ------------------------------------------------------------------------------ arguments


@dataclass
class ReproduceArgs:
    claims: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    """Claim 5 (adaptive sync) runs only when named: --claims 5."""
    seeds: int = 3
    """Seeds per variant (1..seeds)."""
    steps: int = 60
    """Trainer steps per run."""
    window: int = 10
    """Final-window length (steps) of the table and the verdict; also the trailing window of
    "steps to threshold" and the plots' smoothing."""
    margin: float = 0.05
    """Reward difference below which two variants count as equal."""
    z: float | None = None
    """Half-width of the difference's interval in standard errors; None = Student's t 95%
    quantile for the comparison's degrees of freedom (4.30 for 3 paired seeds)."""
    config: str | None = None
    """YAML config; None = the embedded defaults (the tiny job, one process)."""
    overrides: list[str] = field(default_factory=list)
    """key=value applied to every run, after the claims' own settings."""
    nproc: int = 0
    """Ranks per run (torchrun when > 1); 0 = what the config's layout needs (1 for the
    embedded defaults)."""
    out_dir: str = "runs/bench_reproduce"
    timeout_s: float = 1800.0
    threads: int = 1

    def __post_init__(self) -> None:
        bad = [c for c in self.claims if c not in CLAIMS]
        if not self.claims or bad or len(set(self.claims)) != len(self.claims):
            raise ValueError(
                f"--claims {self.claims}: give each of {sorted(CLAIMS)} at most once, e.g. "
                "--claims 1,2,3,4,5."
            )
        if self.seeds < 1 or self.steps < 1 or self.window < 1 or self.nproc < 0:
            raise ValueError(
                f"--seeds({self.seeds}), --steps({self.steps}) and --window({self.window}) "
                f"must be >= 1 (use --seeds 2 or more for a verdict), --nproc({self.nproc}) "
                ">= 0 (0: from the config)."
            )
        if self.margin < 0 or (self.z is not None and self.z <= 0):
            raise ValueError(f"--margin({self.margin}) must be >= 0 and --z({self.z}) > 0.")
        for o in self.overrides:
            if "=" not in o or o.split("=", 1)[0] in RESERVED_KEYS:
                raise ValueError(
                    f"override {o!r}: give key=value, and none of {list(RESERVED_KEYS)}, which "
                    "the benchmark sets itself (--steps, the claims' v, --out-dir, --seeds)."
                )


def check_configs(a: ReproduceArgs) -> int:
    """Load every run's config (claims' keys + ``a.overrides``) before anything starts, so a
    bad key fails in a second, not after an hour; returns ``a.nproc``, or when 0 the ranks
    the config's layout needs (``common.config_nproc``)."""
    for r in plan_runs(a.claims)[0]:
        load_config(a.config, [*r.overrides, *a.overrides, f"sync.interval={r.v}",
                               f"steps={a.steps}"])  # fmt: skip
    if a.nproc:
        return a.nproc
    return config_nproc(a.config, a.overrides)


def estimate_s(n_runs: int, steps: int, start_s: float = START_S, step_s: float = STEP_S) -> float:
    """Wall seconds of ``n_runs`` sequential runs of ``steps`` steps (the cost model above)."""
    return n_runs * (start_s + step_s * steps)


# ------------------------------------------------------------------------------ analysis


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


# Two-sided 95% quantiles of Student's t, t_{0.975}(df) for df = 1..30; 1.96 beyond.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def t975(df: float) -> float:
    """``t_{0.975}(df)``, df rounded down (conservative); 1.96 above 30."""
    k = max(1, int(df))
    return T975[k - 1] if k <= len(T975) else 1.96


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
            raise ValueError(f"paired comparison of {len(a)} and {len(b)} seeds: give both "
                             "variants the same seeds, or paired=False.")  # fmt: skip
        diff, sd = mean_std([x - y for x, y in zip(a, b)])
        se, df = sd / math.sqrt(len(a)), len(a) - 1.0
    else:
        (ma, sa), (mb, sb) = mean_std(a), mean_std(b)
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


# ------------------------------------------------------------------------------ driver


def run_bench_reproduce(a: ReproduceArgs, log=print) -> dict[str, Any]:
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs, run_of = plan_runs(a.claims)
    seeds = list(range(1, a.seeds + 1))
    n = len(runs) * len(seeds)
    log(f"[bench reproduce] claims {a.claims}: {len(runs)} distinct variants x {len(seeds)} "
        f"seeds = {n} runs of {a.steps} steps; estimated wall time {n} x "
        f"{estimate_s(1, a.steps):.0f} s = {estimate_s(n, a.steps) / 60:.0f} min (one 2-core "
        "machine; docs/reproduction.md)")  # fmt: skip
    curves: dict[str, dict[int, list[float]]] = {r.name: {} for r in runs}
    walls: dict[str, dict[int, float]] = {r.name: {} for r in runs}
    syncs: dict[str, dict[int, int]] = {r.name: {} for r in runs}
    vs: dict[str, dict[int, int]] = {r.name: {} for r in runs}
    sync_curves: dict[str, dict[int, dict[str, list]]] = {r.name: {} for r in runs}
    commands: dict[str, str] = {}
    loads: list[float | None] = []
    t0, done = time.perf_counter(), 0
    for seed in seeds:  # round-robin: every variant once per seed, in the same order
        for r in runs:
            run_dir = out / "runs" / r.name / f"seed{seed}"
            # Started afresh: a model built by an earlier invocation with other overrides
            # (hf_model/ is reused when complete) must not leak into this run.
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            v = r.v if r.match is None else matched_v(a.steps, syncs[r.match][seed])
            cmd = train_argv(a.nproc, a.config, run_dir, a.steps, v,
                             [*r.overrides, *a.overrides, *seed_overrides(seed)])  # fmt: skip
            commands.setdefault(r.name, " ".join(cmd))
            loads.append(loadavg())
            wall = run_logged(cmd, run_dir.with_suffix(".log"), a.timeout_s, a.threads)
            rows = read_metrics(run_dir / "metrics.jsonl")
            curves[r.name][seed] = [float(x["reward_mean"]) for x in rows]
            walls[r.name][seed] = wall
            syncs[r.name][seed] = sum(1 for x in rows if x.get("synced"))
            vs[r.name][seed] = None if "sync.mode=adaptive" in r.overrides else v
            sync_curves[r.name][seed] = {"drift": [x.get("drift") for x in rows],
                                         "synced": [bool(x.get("synced")) for x in rows]}  # fmt: skip
            done += 1
            left = (time.perf_counter() - t0) / done * (n - done)
            log(f"[bench reproduce] {done}/{n} {r.name} seed {seed}: final reward "
                f"{seed_figures(curves[r.name][seed], a.window, 0.0)['final']:.3f}, "
                f"{wall:.0f} s; about {left / 60:.0f} min left")  # fmt: skip
            # a killed benchmark keeps what it ran
            _write_curves(out, a, curves, walls, syncs=syncs, vs=vs, sync_curves=sync_curves)
    result = {
        "args": asdict(a), "seeds": seeds, "runs": [asdict(r) for r in runs],
        "commands": commands, "curves": curves, "walls": walls, "syncs": syncs, "vs": vs,
        "sync_curves": sync_curves,
        "wall_s": time.perf_counter() - t0, "loadavg_1m": loads, "machine": machine_info(),
        "claims": {},
    }  # fmt: skip
    return analyze_and_report(result, out)


def analyze_and_report(result: dict[str, Any], out: Path) -> dict[str, Any]:
    """Fill ``result["claims"]`` from ``result["curves"]`` / ``["walls"]`` (run name -> seed
    -> values) with ``result["args"]``'s window, margin and z; write the report files."""
    a = result["args"]
    _, run_of = plan_runs(a["claims"])
    num = lambda d: {int(k): v for k, v in d.items()}  # noqa: E731 -- JSON keys are strings
    result["claims"] = {}
    for cid in a["claims"]:
        claim = CLAIMS[cid]
        cv = {v.name: num(result["curves"][run_of[(cid, v.name)]]) for v in claim.variants}
        wv = {v.name: num(result["walls"][run_of[(cid, v.name)]]) for v in claim.variants}
        sv = {v.name: num(result.get("syncs", {}).get(run_of[(cid, v.name)], {}))
              for v in claim.variants}  # fmt: skip
        vv = {v.name: num(result.get("vs", {}).get(run_of[(cid, v.name)], {}))
              for v in claim.variants}  # fmt: skip
        res = analyze_claim(claim, cv, wv, a["window"], a["margin"], a["z"], sv, vv)
        for v in claim.variants:  # the drift a run let its sampler reach, where logged
            per_seed = result.get("sync_curves", {}).get(run_of[(cid, v.name)], {}).values()
            drifts = [[d for d in c["drift"] if d is not None] for c in per_seed]
            if drifts and all(drifts):
                res["variants"][v.name]["drift_mean"] = mean_std([sum(d) / len(d) for d in drifts])[
                    0
                ]
                res["variants"][v.name]["drift_max"] = mean_std([max(d) for d in drifts])[0]
        res["run_of"] = {v.name: run_of[(cid, v.name)] for v in claim.variants}
        result["claims"][cid] = res
    result["files"] = [str(p) for p in write_reproduce_report(result, out)]
    return result


def report_from_json(path: str | os.PathLike, out_dir: str | os.PathLike) -> dict[str, Any]:
    """Re-analyze a ``reproduce.json`` (or the ``curves.json`` of an interrupted benchmark:
    its claims need every variant's curves) and write the report into ``out_dir``."""
    result = json.loads(Path(path).read_text())
    result.setdefault("machine", {})
    result.setdefault("wall_s", sum(w for r in result["walls"].values() for w in r.values()))
    result.setdefault("seeds", sorted({int(s) for r in result["curves"].values() for s in r}))
    result.setdefault("runs", [asdict(r) for r in plan_runs(result["args"]["claims"])[0]])
    missing = [r for r in plan_runs(result["args"]["claims"])[0]
               if not result["curves"].get(r.name)]  # fmt: skip
    if missing:
        raise ValueError(
            f"{path}: no curves for runs {[r.name for r in missing]}: re-run those claims, or "
            "give the reproduce.json of a finished benchmark."
        )
    return analyze_and_report(result, Path(out_dir))


def _write_curves(out: Path, a: ReproduceArgs, curves: Any, walls: Any, **more: Any) -> None:
    tmp = out / "curves.json.tmp"
    tmp.write_text(json.dumps({"args": asdict(a), "curves": curves, "walls": walls, **more}))
    os.replace(tmp, out / "curves.json")
