"""Plots and markdown for ``bench reproduce`` (the command: ``bench/reproduce/run.py``): a
claim's reward curves, claim 5's drift and interval figure, the per-claim tables and
verdicts (matplotlib's Agg canvas through ``metrics.plots._save``)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_grpo.bench.common import trailing_mean
from megatron_grpo.metrics.plots import _save, drift_axis_floor


def plot_claim(
    claim: Mapping[str, Any],
    curves: Mapping[str, Mapping[Any, list[float]]],
    path: str | os.PathLike,
) -> Path:
    """Reward vs step of one claim: per variant the mean over seeds of each seed's trailing
    ``window``-mean, and a +-std band over seeds; the threshold as a dashed line.
    ``curves[variant][seed]`` is the per-step reward."""
    from matplotlib.figure import Figure

    w = claim["window"]
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    for name, per_seed in curves.items():
        smooth = [trailing_mean(c, w) for c in per_seed.values() if c]
        if not smooth:
            continue
        n = min(map(len, smooth))
        steps = list(range(1, n + 1))
        mean = [sum(s[i] for s in smooth) / len(smooth) for i in range(n)]
        line = ax.plot(steps, mean, lw=1.6, label=f"{name} ({len(smooth)} seeds)")[0]
        if len(smooth) > 1:
            sd = [
                (sum((s[i] - mean[i]) ** 2 for s in smooth) / (len(smooth) - 1)) ** 0.5
                for i in range(n)
            ]
            ax.fill_between(steps, [m - d for m, d in zip(mean, sd)],
                            [m + d for m, d in zip(mean, sd)], color=line.get_color(),
                            alpha=0.15)  # fmt: skip
    ax.axhline(claim["threshold"], color="gray", ls="--", lw=0.8, label="threshold")
    ax.set_xlabel("trainer step")
    ax.set_ylabel(f"reward (trailing {w}-step mean)")
    ax.set_title(f"Claim {claim['id']}: {claim['title']}\nverdict: {claim['verdict']}", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    _save(fig, Path(path))
    return Path(path)


def intervals_since_sync(synced: list[bool]) -> list[int]:
    """Per step, the steps trained on the served weights so far, this one included (the
    ``interval_since_sync`` column of metrics.jsonl), from a run's ``synced`` column."""
    out, since = [], 0
    for flag in synced:
        since += 1
        out.append(since)
        if flag:
            since = 0
    return out


def plot_sync_curves(
    claim: Mapping[str, Any],
    sync_curves: Mapping[str, Mapping[Any, Mapping[str, list]]],
    max_drift: float | None,
    path: str | os.PathLike,
) -> Path:
    """Drift and interval over one run (the first seed) of each variant that logged drift:
    top, the per-step drift (log scale; dots on sync steps) with ``max_drift`` dashed;
    bottom, ``interval_since_sync``. ``sync_curves[variant][seed]``: ``drift``, ``synced``."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5.5))
    top, bottom = fig.subplots(2, 1, sharex=True)
    floors = []
    for name, per_seed in sync_curves.items():
        if not per_seed:
            continue
        seed = sorted(per_seed, key=int)[0]
        c = per_seed[seed]
        steps = list(range(1, len(c["synced"]) + 1))
        since = intervals_since_sync(c["synced"])
        floor = drift_axis_floor(c["drift"], [n == 1 for n in since])
        floors += [floor] if floor else []
        pts = [
            (k, max(d, floor or d)) for k, d in zip(steps, c["drift"]) if d is not None and d > 0
        ]
        if not pts:
            continue
        line = top.plot(
            [k for k, _ in pts], [d for _, d in pts], lw=1.2, label=f"{name} (seed {seed})"
        )[0]
        at = [(k, d) for k, d in pts if c["synced"][k - 1]]
        top.plot([k for k, _ in at], [d for _, d in at], "o", ms=3, color=line.get_color())
        bottom.step(steps, since, where="mid", lw=1.2, color=line.get_color(), label=name)
    if max_drift is not None:
        top.axhline(max_drift, color="gray", ls="--", lw=0.8, label=f"max_drift {max_drift:g}")
    top.set_yscale("log")
    if floors:  # the mismatch right after a sync (~1e-14 on CPU) is drawn on the floor
        top.set_ylim(bottom=min(floors))
    top.set_ylabel("drift: KL(alpha || pi_k) per token")
    top.set_title(
        f"Claim {claim['id']}: drift and interval since the last sync (dots: syncs)", fontsize=8
    )
    bottom.set_ylabel("steps since last sync")
    bottom.set_xlabel("trainer step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    _save(fig, Path(path))
    return Path(path)


def _sync_table(c: Mapping[str, Any], steps: int) -> list[str]:
    """Syncs per run, the v each seed used, syncs saved against v = 1, wall time per run."""
    rows = [(n, v) for n, v in c["variants"].items() if v.get("syncs_mean") is not None]
    if not rows:
        return []
    lines = ["", f"| variant | syncs per run (mean +- std) | v per seed | syncs saved vs v=1 "
                 f"({steps} syncs) | drift per token: run mean / run max (mean over seeds) "
                 "| wall s/run |", "|---|---|---|---|---|---|"]  # fmt: skip
    for name, v in rows:
        per = {k: x for k, x in (v.get("v_per_seed") or {}).items() if x is not None}
        vtxt = ", ".join(f"{per[k]}" for k in sorted(per, key=int)) if per else "- (adaptive)"
        wall = v["wall_s_mean"]
        drift = (f"{v['drift_mean']:.2g} / {v['drift_max']:.2g}" if v.get("drift_mean") is not None
                 else "-")  # fmt: skip
        lines.append(
            f"| {name} | {_pm(v['syncs_mean'], v['syncs_std'])} | {vtxt} | "
            f"{steps - v['syncs_mean']:.1f} | {drift} | "
            f"{'-' if wall is None else f'{wall:.0f}'} |"
        )
    return lines


def _pm(m: float | None, s: float | None) -> str:
    if m is None:
        return "-"
    return f"{m:.3f}" if s is None else f"{m:.3f} +- {s:.3f}"


def reproduce_markdown(res: Mapping[str, Any]) -> str:
    """Per claim: the table (final-window reward mean +- std over seeds, mean reward over
    all steps, steps to the threshold, wall time per run), the comparisons and the verdict."""
    a = res["args"]
    lines = [
        f"Runs: {a['steps']} steps each, seeds {res['seeds']}, round-robin; final window = "
        f"last {a['window']} steps; margin {a['margin']:g}; interval "
        f"{'95% Student t' if a['z'] is None else str(a['z']) + ' standard errors'}; "
        f"nproc={a['nproc']}; config={a['config'] or 'embedded defaults'}; extra "
        f"overrides: `{' '.join(a['overrides']) or '(none)'}`. Total wall time "
        f"{res['wall_s'] / 60:.1f} min on {res['machine'].get('cpu', '?')} "
        f"({res['machine'].get('nproc', '?')} CPUs).",
        "",
        "| claim | verdict |",
        "|---|---|",
    ]
    claims = res["claims"]
    lines += [f"| {c['id']}. {c['title']} | **{c['verdict']}** |" for c in claims.values()]
    for c in claims.values():
        w = c["window"]
        lines += [
            "",
            f"### Claim {c['id']}: {c['title']}",
            "",
            f"Source: {c['source']}. Task settings: `{' '.join(c['task']) or '(the default)'}`.",
            "",
            f"| variant | run | final {w}-step reward (mean +- std) | mean reward, all steps "
            f"| steps to {c['threshold']:g} (seeds reaching) | wall s/run |",
            "|---|---|---|---|---|---|",
        ]
        for name, v in c["variants"].items():
            st = v["steps_to_threshold_mean"]
            wall = v["wall_s_mean"]
            lines.append(
                f"| {name} | {c.get('run_of', {}).get(name, '-')} | "
                f"{_pm(v['final_mean'], v['final_std'])} | {_pm(v['auc_mean'], v['auc_std'])} "
                f"| {'-' if st is None else f'{st:.1f}'} ({v['reached']}/{len(v['seeds'])}) | "
                f"{'-' if wall is None else f'{wall:.0f}'} |"
            )
        lines += _sync_table(c, a["steps"])
        lines += ["", "| comparison | metric | verdict | why |", "|---|---|---|---|"]
        for k in c["comparisons"]:
            rel = "better than" if k["kind"] == "better" else "matches"
            lines.append(
                f"| {k['a']} {rel} {k['b']} | {k['metric']} | {k['verdict']} | {k['reason']} |"
            )
        lines += ["", f"Verdict: **{c['verdict']}** (figure: `claim{c['id']}.png`)."]
    return "\n".join(lines)


def _max_drift(res: Mapping[str, Any], c: Mapping[str, Any]) -> float | None:
    """``sync.max_drift`` of the claim's adaptive run (from its overrides), if any."""
    for r in res.get("runs", []):
        if r["name"] in c["run_of"].values():
            for o in r["overrides"]:
                if o.startswith("sync.max_drift="):
                    return float(o.split("=", 1)[1])
    return None


def write_reproduce_report(res: Mapping[str, Any], out_dir: str | os.PathLike) -> list[Path]:
    """``claim<N>.png`` per claim, ``claim<N>_sync.png`` for a claim whose runs logged drift
    (``plot_sync_curves``), ``reproduce.md`` (the tables) and ``reproduce.json`` (args,
    per-seed curves, per-run wall times, syncs, summaries and verdicts)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for cid, c in res["claims"].items():
        per_variant = {name: res["curves"][run] for name, run in c["run_of"].items()}
        files.append(plot_claim(c, per_variant, out / f"claim{cid}.png"))
        sync = {name: res.get("sync_curves", {}).get(run, {}) for name, run in c["run_of"].items()}
        if any(d is not None for per in sync.values() for x in per.values() for d in x["drift"]):
            files.append(
                plot_sync_curves(c, sync, _max_drift(res, c), out / f"claim{cid}_sync.png")
            )
    md = out / "reproduce.md"
    md.write_text("# bench reproduce\n\n" + reproduce_markdown(res) + "\n")
    js = out / "reproduce.json"
    js.write_text(json.dumps(res, indent=2, default=str))
    return [*files, md, js]
