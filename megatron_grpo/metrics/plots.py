"""PNG plots of a run: reward over steps (sync steps marked) and the per-step time breakdown.

Uses matplotlib's object API with the Agg canvas directly instead of ``pyplot``: no global
backend switch, no GUI, safe in any process (``matplotlib.use`` would change the backend
for the whole program).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_grpo.metrics.schema import PHASES


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _save(fig: Any, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    os.replace(tmp, path)


def plot_reward(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """Reward mean (with a +-std band) over steps; vertical lines at steps that synced."""
    from matplotlib.figure import Figure

    path = Path(path)
    pts = [
        (r["step"], m, _num(r.get("reward_std")))
        for r in rows
        if (m := _num(r.get("reward_mean"))) is not None
    ]
    fig = Figure(figsize=(8, 4))
    ax = fig.add_subplot()
    if pts:
        steps = [p[0] for p in pts]
        mean = [p[1] for p in pts]
        ax.plot(steps, mean, color="tab:blue", lw=1.5, label="reward mean")
        std = [p[2] for p in pts if p[2] is not None]
        if len(std) == len(pts):
            lo = [m - s for m, s in zip(mean, std, strict=True)]
            hi = [m + s for m, s in zip(mean, std, strict=True)]
            ax.fill_between(steps, lo, hi, color="tab:blue", alpha=0.15, label="+- std")
    evals = [(r["step"], v) for r in rows if (v := _num(r.get("eval_pass@1"))) is not None]
    if evals:  # validation during training (eval.interval)
        ax.plot([e[0] for e in evals], [e[1] for e in evals], "o-", color="tab:green", lw=1.2,
                ms=3, label="held-out pass@1 (eval.interval)")  # fmt: skip
    synced = [r["step"] for r in rows if r.get("synced")]
    for i, s in enumerate(synced):
        ax.axvline(
            s, color="tab:orange", lw=0.8, alpha=0.6, label="weight sync" if i == 0 else None
        )
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title("Reward over training (orange: vLLM weight syncs)")
    ax.grid(alpha=0.3)
    if pts or synced or evals:
        ax.legend(loc="best", fontsize=8)
    _save(fig, path)
    return path


def plot_step_times(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """Stacked bars of the per-step phase times; 'other' is time_step minus the phases."""
    from matplotlib.figure import Figure

    path = Path(path)
    steps = [r["step"] for r in rows]
    fig = Figure(figsize=(9, 4))
    ax = fig.add_subplot()
    bottom = [0.0] * len(rows)
    colors = ("tab:blue", "tab:green", "tab:purple", "tab:red", "tab:orange")
    for phase, color in zip(PHASES, colors):
        vals = [_num(r.get(f"time_{phase}")) or 0.0 for r in rows]
        if any(vals):
            ax.bar(steps, vals, bottom=bottom, width=0.9, color=color, label=phase)
            bottom = [b + v for b, v in zip(bottom, vals)]
    other = [max((_num(r.get("time_step")) or b) - b, 0.0) for r, b in zip(rows, bottom)]
    if any(other):
        ax.bar(steps, other, bottom=bottom, width=0.9, color="tab:gray", label="other")
    totals = [b + o for b, o in zip(bottom, other)]
    if top := step_time_axis_top(totals):  # step 1's start-up cost clipped, its value written
        ax.set_ylim(0, top)
        ax.annotate(
            f"{totals[0]:.1f} s (start-up)", (steps[0], top), xytext=(4, -12),
            textcoords="offset points", fontsize=8,
        )  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("Time per step by phase")
    ax.grid(alpha=0.3, axis="y")
    if rows:
        ax.legend(loc="upper right", fontsize=8)
    _save(fig, path)
    return path


def step_time_axis_top(totals: Sequence[float]) -> float | None:
    """The y axis's upper end when the first step (compilation, vLLM's first graphs, the
    first rollout) is more than twice as slow as any later one: 1.25x the slowest later step,
    so the later bars stay readable; None (matplotlib's own) otherwise."""
    if len(totals) < 2:
        return None
    rest = max(totals[1:])
    return 1.25 * rest if rest > 0 and totals[0] > 2 * rest else None


def drift_axis_floor(drifts: Sequence[float | None], after_sync: Sequence[bool]) -> float | None:
    """A log axis's lower end for drift curves: a tenth of the smallest drift measured with
    weights at least one update away from the served ones. Right after a sync the drift is
    only the vLLM-vs-trainer mismatch (~1e-14 on CPU fp32), which would squash the curve;
    values below the floor are drawn on it."""
    moved = [d for d, first in zip(drifts, after_sync) if d is not None and d > 0 and not first]
    return min(moved) / 10 if moved else None


def plot_drift(
    rows: Sequence[Mapping[str, Any]], path: str | os.PathLike, max_drift: float | None = None
) -> Path:
    """Top: ``drift`` per step (log scale; dots on the steps that synced) and ``max_drift``
    dashed; bottom: ``interval_since_sync``."""
    from matplotlib.figure import Figure

    path = Path(path)
    fig = Figure(figsize=(8, 5))
    top, bottom = fig.subplots(2, 1, sharex=True)
    floor = drift_axis_floor(
        [_num(r.get("drift")) for r in rows], [r.get("interval_since_sync") == 1 for r in rows]
    )
    pts = [(r["step"], _num(r.get("drift")), bool(r.get("synced"))) for r in rows]
    pts = [(k, max(d, floor or d), s) for k, d, s in pts if d is not None and d > 0]
    top.plot([p[0] for p in pts], [p[1] for p in pts], color="tab:purple", lw=1.2, label="drift")
    top.plot([p[0] for p in pts if p[2]], [p[1] for p in pts if p[2]], "o", ms=3,
             color="tab:orange", label="synced")  # fmt: skip
    if max_drift is not None:
        top.axhline(max_drift, color="gray", ls="--", lw=0.8, label=f"max_drift {max_drift:g}")
    top.set_yscale("log")
    if floor:
        top.set_ylim(bottom=floor)
    top.set_ylabel("KL(alpha || pi_k) per token")
    top.set_title("Drift of the trainer's policy from the served one, and the sync interval")
    since = [(r["step"], r.get("interval_since_sync")) for r in rows]
    since = [p for p in since if p[1] is not None]
    bottom.step([p[0] for p in since], [p[1] for p in since], where="mid", color="tab:blue")
    bottom.set_ylabel("steps since last sync")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.legend(loc="best", fontsize=8)
    _save(fig, path)
    return path


def plot_ratio_parts(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """``grpo.off_policy.score_alpha``: ``staleness_kl`` and ``numerics_kl`` per step on one log
    axis (a step whose value is exactly 0, staleness at lag 0, has no point)."""
    from matplotlib.figure import Figure

    path = Path(path)
    fig = Figure(figsize=(8, 3.5))
    ax = fig.subplots()
    for key, color in (("staleness_kl", "tab:purple"), ("numerics_kl", "tab:green")):
        pts = [(r["step"], v) for r in rows if (v := _num(r.get(key))) is not None and v > 0]
        ax.plot(
            [p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, lw=1.2, color=color, label=key
        )
    for r in rows:
        if r.get("synced"):
            ax.axvline(r["step"], color="gray", lw=0.6, alpha=0.5)
    ax.set_yscale("log")
    ax.set_ylabel("KL per token")
    ax.set_xlabel("step (gray: a sync after it)")
    ax.set_title("The ratio's two parts: staleness KL(alpha || pi_k), numerics KL(vLLM || trainer)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    _save(fig, path)
    return path


def write_plots(
    run_dir: str | os.PathLike, rows: Sequence[Mapping[str, Any]], max_drift: float | None = None
) -> list[Path]:
    """Write ``reward.png`` and ``step_time.png`` into the run directory, and ``drift.png``
    when the run measured its drift (``sync.mode=adaptive`` or
    ``grpo.off_policy.ratio_mode=exact``), and ``ratio_parts.png`` when it split the ratio
    (``grpo.off_policy.score_alpha``)."""
    run_dir = Path(run_dir)
    out = [
        plot_reward(rows, run_dir / "reward.png"),
        plot_step_times(rows, run_dir / "step_time.png"),
    ]
    if any(_num(r.get("drift")) is not None for r in rows):
        out.append(plot_drift(rows, run_dir / "drift.png", max_drift))
    if any(_num(r.get("numerics_kl")) is not None for r in rows):
        out.append(plot_ratio_parts(rows, run_dir / "ratio_parts.png"))
    return out
