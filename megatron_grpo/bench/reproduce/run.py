"""``megatron-grpo bench reproduce``: the source papers' claims, at tiny-model scale, with seeds.

Design: docs/reproduction.md, "How bench reproduce runs (bench/reproduce/run.py)".
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_grpo.bench.common import (
    config_nproc,
    loadavg,
    machine_info,
    run_logged,
    train_argv,
)
from megatron_grpo.bench.reproduce.claims import CLAIMS, matched_sync_interval, plan_runs
from megatron_grpo.bench.reproduce.report import write_reproduce_report
from megatron_grpo.bench.reproduce.stats import analyze_claim, mean_std, seed_figures
from megatron_grpo.config import load_config
from megatron_grpo.metrics.logger import read_metrics

SEED_KEYS = ("seed", "rollout.seed", "data.shuffle_seed")
RESERVED_KEYS = ("steps", "sync.interval", "sync.mode", "run_dir", *SEED_KEYS)

# Cost model of one run, for the estimate printed at start: start-up (model build, warm
# start, Megatron, vLLM engine) + seconds per step of the tiny default job (one process,
# OMP_NUM_THREADS=1). Measured on the 2-core machine of docs/reproduction.md: a 60-step run
# took 45 s after boot (cold imports, 15 s engine start) and 20-27 s with warm caches;
# the constants round that up (60 steps -> 36 s), so the estimate is a ceiling.
START_S, STEP_S = 15.0, 0.35


def reward_of(row: dict[str, Any]) -> float:
    """A step's reward on the curves: ``reward_mean``, or with grpo.dynamic_sampling the mean
    over every generated response (``ds_reward_mean``; the kept groups' mean is biased)."""
    return float(row.get("ds_reward_mean", row["reward_mean"]))


def seed_overrides(seed: int) -> list[str]:
    return [f"{k}={seed}" for k in SEED_KEYS]


# ------------------------------------------------------------------------------ arguments


@dataclass
class ReproduceArgs:
    claims: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    """Claims 5, 6 and 7 (adaptive sync; by staleness alone; dynamic sampling) run only when
    named: --claims 5,6,7."""
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
    vs: dict[str, dict[int, int | None]] = {r.name: {} for r in runs}
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
            sync_interval = (
                r.v if r.match is None else matched_sync_interval(a.steps, syncs[r.match][seed])
            )
            cmd = train_argv(a.nproc, a.config, run_dir, a.steps, sync_interval,
                             [*r.overrides, *a.overrides, *seed_overrides(seed)])  # fmt: skip
            commands.setdefault(r.name, " ".join(cmd))
            loads.append(loadavg())
            wall = run_logged(cmd, run_dir.with_suffix(".log"), a.timeout_s, a.threads)
            rows = read_metrics(run_dir / "metrics.jsonl")
            curves[r.name][seed] = [reward_of(x) for x in rows]
            walls[r.name][seed] = wall
            syncs[r.name][seed] = sum(1 for x in rows if x.get("synced"))
            vs[r.name][seed] = None if "sync.mode=adaptive" in r.overrides else sync_interval
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
