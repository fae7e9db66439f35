"""``megatron-grpo bench throughput``: the real training loop at several sync periods v.

One ``megatron-grpo train`` process per v (under torchrun when ``nproc > 1``), the same
config, seed and overrides, run one after the other in one invocation; each run's
``metrics.jsonl`` is read back and reduced to:

- steps/s and tokens/s over the measured steps, and their ratio to the smallest v;
- the mean seconds per step of each phase (rollout, reward, logprobs, train, sync, other =
  time_step minus the named phases), sync counted 0 on steps that did not sync -- so the
  mean ``sync`` column *is* the sync cost amortized per step;
- the sync count and the mean seconds per sync.

Warm-up: the first ``warmup`` steps of every run are left out of every rate and mean
(first-call costs: vLLM's first generate, allocator growth, the first optimizer step).
The measured window holds exactly ``(steps - warmup) / v`` syncs only when v divides
``steps - warmup``; :func:`check_args` refuses windows that would give one v an unfair
share of syncs (pick ``steps = warmup + k * lcm(vs)``).

Every process started here is waited for, or killed through its own process group (its
id), before the function returns.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
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
from megatron_grpo.bench.projection.window_schedule import schedule_step_time
from megatron_grpo.bench.throughput.report import write_throughput_report
from megatron_grpo.config import load_config
from megatron_grpo.metrics.logger import read_metrics
from megatron_grpo.rollout.server import PIN_ENV

PHASES = ("rollout", "reward", "logprobs", "train", "sync")


@dataclass
class ThroughputArgs:
    vs: list[int] = field(default_factory=lambda: [1, 2, 5, 10])
    """The sync periods to compare; the smallest is the reference of every ratio."""
    steps: int = 11
    """Trainer steps per run (warm-up included)."""
    warmup: int = 1
    """Leading steps of every run left out of the rates and means."""
    config: str | None = None
    """YAML config; None = configs/tiny_cpu.yaml when it exists, else the embedded defaults."""
    overrides: list[str] = field(default_factory=list)
    """key=value overrides passed to every run (the same for every v)."""
    nproc: int = 0
    """Ranks per run: 1 = one process, > 1 = torchrun --standalone --nproc-per-node;
    0 = what the config's layout needs (parallel.tp * pp * max(dp, 1))."""
    out_dir: str = "runs/bench_throughput"
    """One run directory per v under here (``v{v}/``), plus the report files."""
    timeout_s: float = 1800.0
    """Time limit of one run."""
    rounds: int = 1
    """Run every v this many times, round-robin (v1 v2 ... v1 v2 ...); steps are pooled."""
    threads: int = 1
    """OMP_NUM_THREADS of each rank."""
    aheads: list[int] = field(default_factory=lambda: [0])
    """rollout.ahead values; every (v, ahead) pair runs, side by side (0 = serial)."""
    pin: bool = True
    """Disaggregated runs: trainer ranks on one half of this process's cores, rollout ranks
    (and vLLM's processes, which inherit it) on the other (``PIN_ENV``), so that the overlap
    of rollout.ahead is real on a small machine."""

    def __post_init__(self) -> None:
        check_args(self)

    @property
    def measured_steps(self) -> int:
        return self.steps - self.warmup


def check_args(a: ThroughputArgs) -> None:
    if not a.vs or any(sync_interval < 1 for sync_interval in a.vs):
        raise ValueError(f"--v {a.vs}: give sync periods >= 1, e.g. --v 1,2,5,10.")
    if len(set(a.vs)) != len(a.vs):
        raise ValueError(f"--v {a.vs}: each v once.")
    if not a.aheads or any(x < 0 for x in a.aheads) or len(set(a.aheads)) != len(a.aheads):
        raise ValueError(f"--ahead {a.aheads}: give distinct values >= 0, e.g. --ahead 0,3.")
    if a.warmup < 0 or a.nproc < 0 or a.threads < 1 or a.rounds < 1:
        raise ValueError(
            f"--warmup({a.warmup}) and --nproc({a.nproc}) must be >= 0 (nproc 0: from the "
            f"config), --rounds({a.rounds}) and threads({a.threads}) >= 1."
        )
    n = a.steps - a.warmup
    if n < 1:
        raise ValueError(
            f"--steps({a.steps}) leaves no measured step after --warmup({a.warmup}): use "
            f"--steps {a.warmup + max(a.vs)} or more."
        )
    bad = [sync_interval for sync_interval in a.vs if n % sync_interval]
    if bad:
        lcm = math.lcm(*a.vs)
        raise ValueError(
            f"--steps({a.steps}) - --warmup({a.warmup}) = {n} measured steps is not a multiple "
            f"of v in {bad}: those runs would sync a different share of the measured steps. "
            f"Use --steps {a.warmup + lcm * max(1, round(n / lcm))} (warm-up + a multiple of "
            f"lcm(v) = {lcm})."
        )
    for o in a.overrides:
        key = o.split("=", 1)[0]
        if "=" not in o or key in ("steps", "sync.interval", "run_dir", "seed", "rollout.ahead"):
            raise ValueError(
                f"override {o!r}: give key=value, and not steps / sync.interval / run_dir / "
                "seed / rollout.ahead, which the benchmark sets itself (--steps, --v, "
                "--out-dir, --ahead; the config's seed is shared by every run)."
            )


def default_config() -> str | None:
    """configs/tiny_cpu.yaml of the repository when it exists, else None (embedded defaults)."""
    path = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
    return str(path) if path.is_file() else None


def train_command(
    a: ThroughputArgs, sync_interval: int, run_dir: Path, ahead: int = 0
) -> list[str]:
    """The command line of the run for sync period ``sync_interval`` (and rollout.ahead
    ``ahead``)."""
    extra = [] if a.aheads == [0] else [f"rollout.ahead={ahead}"]
    return train_argv(a.nproc, a.config, run_dir, a.steps, sync_interval, [*a.overrides, *extra])


"""CPU lists (``0``, ``0-3``, ``0,2``) that ``rollout.server.join_world`` applies with
``os.sched_setaffinity`` to trainer and rollout ranks (vLLM's processes inherit theirs)."""


def pin_env(cpus: Iterable[int]) -> dict[str, str]:
    """Trainer ranks on the first half of ``cpus``, rollout ranks on the rest."""
    ordered = sorted(cpus)
    if len(ordered) < 2:
        return {}
    half = len(ordered) // 2
    return {
        PIN_ENV[0]: ",".join(map(str, ordered[:half])),
        PIN_ENV[1]: ",".join(map(str, ordered[half:])),
    }


# ------------------------------------------------------------------------------ analysis


def _f(row: Mapping[str, Any], key: str) -> float:
    x = row.get(key)
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else 0.0


def analyze_run(
    rows: Sequence[Mapping[str, Any]], sync_interval: int, warmup: int
) -> dict[str, Any]:
    """Rates and phase means of one run's metrics rows, its first ``warmup`` steps left out."""
    return analyze_rounds([rows], sync_interval, warmup)


def analyze_rounds(
    rounds: Sequence[Sequence[Mapping[str, Any]]], sync_interval: int, warmup: int, ahead: int = 0
) -> dict[str, Any]:
    """Like :func:`analyze_run` over several runs of the same v (rounds), their measured
    steps pooled; ``steps_per_s_by_round`` keeps each round's own rate."""
    per_round = [[r for r in rows if r["step"] > warmup] for rows in rounds]
    if not all(per_round):
        n_rows = [len(rows) for rows in rounds]
        raise ValueError(
            f"v={sync_interval}: no step after the {warmup} warm-up step(s) in {n_rows} rows"
        )
    measured = [r for rr in per_round for r in rr]
    rows = rounds[0]
    n = len(measured)
    step_s = [_f(r, "time_step") for r in measured]
    total = sum(step_s)
    tokens = sum(_f(r, "tokens_per_s") * _f(r, "time_step") for r in measured)
    phases = {p: sum(_f(r, f"time_{p}") for r in measured) / n for p in PHASES}
    phases["other"] = max(0.0, total / n - sum(phases.values()))
    synced = [r for r in measured if r.get("synced")]
    sync_s = [_f(r, "time_sync") for r in synced]
    by_round = [len(rr) / sum(_f(r, "time_step") for r in rr) for rr in per_round]
    return {
        "v": sync_interval,
        "ahead": ahead,
        "rounds": len(rounds),
        "steps_logged": len(rows),
        "measured_steps": n,
        "warmup_steps": len(rows) - len(per_round[0]),
        "num_syncs": sum(1 for r in rows if r.get("synced")),
        "measured_syncs": len(synced),
        "synced_steps": [r["step"] for r in rows if r.get("synced")],
        "step_time_mean_s": total / n,
        "steps_per_s": n / total if total else None,
        "steps_per_s_by_round": by_round,
        "tokens_per_s": tokens / total if total else None,
        "phase_mean_s": phases,
        "sync_time_mean_s": sum(sync_s) / len(sync_s) if sync_s else None,
        "sync_amortized_s": phases["sync"],
        "sync_bytes_mean": (
            sum(_f(r, "sync_bytes") for r in synced) / len(synced) if synced else None
        ),
        # grpo.off_policy.score_alpha: alpha's log-prob pass per step (part of "train"; 0 at lag 0)
        "score_alpha_mean_s": (
            sum(_f(r, "time_score_alpha") for r in measured) / n
            if any("time_score_alpha" in r for r in rows)
            else None
        ),
        "response_len_mean": sum(_f(r, "response_len_mean") for r in measured) / n,
        "reward_mean": sum(_f(r, "reward_mean") for r in measured) / n,
    }


def _key(r: Mapping[str, Any]) -> tuple[int, int]:
    return r["v"], r.get("ahead", 0)


def predicted_ahead_speedup(serial: Mapping[str, Any], run: Mapping[str, Any]) -> float | None:
    """What ``bench.window_schedule.window_time`` predicts for ``run``'s rollout.ahead from the
    serial run's phases: R = rollout + reward, T = logprobs + train + other, S = seconds per
    sync (colocated: no batching gain assumed, f = 0, as on a saturated CPU)."""
    p, sync_interval = serial["phase_mean_s"], serial["v"]
    r, t = p["rollout"] + p["reward"], p["logprobs"] + p["train"] + p["other"]
    s = serial["sync_time_mean_s"] or 0.0
    placement = run.get("placement", "colocated")
    ahead = run.get("ahead", 0)
    return schedule_step_time(r, t, s, sync_interval, 0, placement) / schedule_step_time(
        r, t, s, sync_interval, ahead, placement
    )


def compare(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Ratios of every run to the run with the smallest v (and smallest ahead), and of every
    run to the serial run (ahead 0) of its own v (``ahead_speedup``)."""
    ref = min(runs, key=_key)
    serial = {r["v"]: r for r in runs if r.get("ahead", 0) == 0}
    out = []
    for r in sorted(runs, key=_key):
        r = dict(r)
        base = serial.get(r["v"])
        r["ahead_speedup"] = (
            r["steps_per_s"] / base["steps_per_s"]
            if base and r["steps_per_s"] and base["steps_per_s"]
            else None
        )
        r["ahead_speedup_predicted"] = predicted_ahead_speedup(base, r) if base else None
        r["steps_per_s_ratio"] = (
            r["steps_per_s"] / ref["steps_per_s"]
            if r["steps_per_s"] and ref["steps_per_s"]
            else None
        )
        r["tokens_per_s_ratio"] = (
            r["tokens_per_s"] / ref["tokens_per_s"]
            if r["tokens_per_s"] and ref["tokens_per_s"]
            else None
        )
        # What the sync saving alone predicts: the reference's step time with its amortized
        # sync replaced by this run's (other phases held at the reference's values).
        t_ref = ref["step_time_mean_s"]
        t_pred = t_ref - ref["sync_amortized_s"] + r["sync_amortized_s"]
        r["sync_only_ratio"] = t_ref / t_pred if t_pred > 0 else None
        # Round i of every v ran back to back: the median of per-round ratios cancels a
        # background load that drifts between rounds.
        pairs = zip(r.get("steps_per_s_by_round", []), ref.get("steps_per_s_by_round", []))
        per = sorted(x / y for x, y in pairs if x and y)
        r["steps_per_s_ratio_median_of_rounds"] = (
            (per[(len(per) - 1) // 2] + per[len(per) // 2]) / 2 if per else None
        )
        out.append(r)
    return {"reference_v": ref["v"], "reference_ahead": ref.get("ahead", 0), "runs": out}


# ------------------------------------------------------------------------------ driver


def run_bench_throughput(a: ThroughputArgs, report: bool = True) -> dict[str, Any]:
    if a.nproc == 0:
        a.nproc = config_nproc(a.config, a.overrides)
    placement = load_config(a.config, list(a.overrides)).rollout.placement
    env = pin_env(os.sched_getaffinity(0)) if a.pin and placement == "disaggregated" else {}
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pairs = [(sync_interval, x) for sync_interval in sorted(a.vs) for x in sorted(a.aheads)]
    commands: dict[tuple[int, int], str] = {}
    rows_of: dict[tuple[int, int], list] = {k: [] for k in pairs}
    walls: dict[tuple[int, int], list[float]] = {k: [] for k in pairs}
    loads: dict[tuple[int, int], list] = {k: [] for k in pairs}
    t_all = time.perf_counter()
    for rnd in range(a.rounds):  # round-robin: every pair sees the same drift of background load
        for sync_interval, x in pairs:
            name = f"v{sync_interval}" if a.aheads == [0] else f"v{sync_interval}_a{x}"
            name += "" if a.rounds == 1 else f"_r{rnd}"
            run_dir = out / name
            cmd = train_command(a, sync_interval, run_dir, x)
            commands.setdefault((sync_interval, x), " ".join(cmd))
            print(f"[bench throughput] {name}: {' '.join(cmd)}", flush=True)
            run_dir.mkdir(parents=True, exist_ok=True)
            load_before = loadavg()
            wall = run_logged(cmd, out / f"{name}.log", a.timeout_s, a.threads, env)
            rows = read_metrics(run_dir / "metrics.jsonl")
            rows_of[(sync_interval, x)].append(rows)
            walls[(sync_interval, x)].append(wall)
            # On a shared machine other jobs' load moves every rate: keep it with the figures.
            loads[(sync_interval, x)].append([load_before, loadavg()])
            one = analyze_run(rows, sync_interval, a.warmup)
            print(
                f"[bench throughput] {name}: {one['steps_per_s']:.4f} steps/s, "
                f"{one['num_syncs']} syncs, {wall:.0f} s wall",
                flush=True,
            )
    runs = []
    for sync_interval, x in pairs:
        res = analyze_rounds(rows_of[(sync_interval, x)], sync_interval, a.warmup, ahead=x)
        res.update(placement=placement, wall_s=walls[(sync_interval, x)],
                   loadavg_1m=loads[(sync_interval, x)][0],
                   loadavg_1m_by_round=loads[(sync_interval, x)])  # fmt: skip
        runs.append(res)
    result = compare(runs)
    result.update(
        args=asdict(a),
        commands={f"v{sync_interval}_a{x}": c for (sync_interval, x), c in commands.items()},
        wall_s=time.perf_counter() - t_all,
        pinning=env or None,
        warmup_note=f"the first {a.warmup} step(s) of every run are excluded from rates/means",
        machine=machine_info(),
    )
    if report:
        result["files"] = [str(p) for p in write_throughput_report(result, out)]
    return result
