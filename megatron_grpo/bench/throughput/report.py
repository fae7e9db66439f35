"""Plots and markdown for ``bench throughput`` and ``bench project`` (matplotlib's Agg
canvas through ``metrics.plots._save``; no pyplot, no global backend switch)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_grpo.bench.common import format_table
from megatron_grpo.bench.projection.window_schedule import window_events
from megatron_grpo.metrics.plots import _save

PHASE_COLORS = {
    "rollout": "tab:blue", "reward": "tab:green", "logprobs": "tab:purple",
    "train": "tab:red", "sync": "tab:orange", "other": "tab:gray",
}  # fmt: skip


def plot_throughput(res: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """steps/s and tokens/s ratios to the reference v, and what the sync saving alone
    predicts; the paper's 1.35x at v=10 (Qwen2.5-7B, 8xH100) as a marker."""
    from matplotlib.figure import Figure

    all_runs = res["runs"]
    fig = Figure(figsize=(6, 3.6))
    ax = fig.add_subplot()
    for ahead in sorted({r.get("ahead", 0) for r in all_runs}):
        runs = [r for r in all_runs if r.get("ahead", 0) == ahead]
        vs = [r["v"] for r in runs]
        tag = "" if ahead == 0 else f", ahead={ahead}"
        ax.plot(vs, [r["steps_per_s_ratio"] for r in runs], "o-", label=f"steps/s{tag}")
        ax.plot(vs, [r["tokens_per_s_ratio"] for r in runs], "s--", label=f"tokens/s{tag}")
        if ahead == 0:
            ax.plot(vs, [r["sync_only_ratio"] for r in runs], "^:", label="sync saving alone")
    vs = sorted({r["v"] for r in all_runs})
    ax.plot([10], [1.35], "k*", ms=10, label="paper, 7B on 8xH100")
    ax.axhline(1.0, color="gray", lw=0.6)
    ax.set_xlabel("sync period v (steps)")
    ax.set_ylabel(f"throughput / throughput at v={res['reference_v']}")
    ax.set_title("Throughput vs sync period (this machine, tiny default)", fontsize=9)
    ax.set_xticks(vs)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    _save(fig, Path(path))
    return Path(path)


def plot_phases(res: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Mean seconds per step by phase, stacked, one bar per v (sync amortized per step)."""
    from matplotlib.figure import Figure

    runs = res["runs"]
    labels = [f"v={r['v']}" + (f" a={r['ahead']}" if r.get("ahead") else "") for r in runs]
    fig = Figure(figsize=(6, 3.6))
    ax = fig.add_subplot()
    bottom = [0.0] * len(runs)
    for phase, color in PHASE_COLORS.items():
        vals = [r["phase_mean_s"][phase] for r in runs]
        ax.bar(labels, vals, bottom=bottom, color=color, label=phase)
        bottom = [b + x for b, x in zip(bottom, vals)]
    ax.set_ylabel("seconds per step (mean over measured steps)")
    ax.set_title("Per-step time by phase (sync amortized per step)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    _save(fig, Path(path))
    return Path(path)


def _figures(r: Mapping[str, Any]) -> dict[str, str]:
    """One run's figures as both throughput tables print them (console and markdown)."""
    p = r["phase_mean_s"]
    sps = r["sync_time_mean_s"]
    return {
        "v": str(r["v"]), "ahead": str(r.get("ahead", 0)),
        "steps/s": f"{r['steps_per_s']:.4f}", "steps ratio": f"{r['steps_per_s_ratio']:.3f}",
        "tok/s": f"{r['tokens_per_s']:.1f}", "tok ratio": f"{r['tokens_per_s_ratio']:.3f}",
        "syncs": str(r["num_syncs"]), "s/sync": "-" if sps is None else f"{sps:.3f}",
        "sync/step": f"{r['sync_amortized_s']:.3f}",
        **{phase: f"{p[phase]:.3f}" for phase in ("rollout", "reward", "logprobs", "train", "other")},
        "step": f"{r['step_time_mean_s']:.3f}",
    }  # fmt: skip


CONSOLE_COLUMNS = (
    ("v", "v", 3), ("ahead", "ahead", 6), ("steps/s", "steps/s", 9), ("ratio", "steps ratio", 7),
    ("tok/s", "tok/s", 8), ("ratio", "tok ratio", 7), ("syncs", "syncs", 6),
    ("s/sync", "s/sync", 8), ("sync/step", "sync/step", 10), ("rollout", "rollout", 8),
    ("reward", "reward", 7), ("logp", "logprobs", 6), ("train", "train", 7),
    ("other", "other", 7), ("step", "step", 7),
)  # fmt: skip
"""(title, key of :func:`_figures`, width) of each column of the console table."""


def throughput_table(res: Mapping[str, Any]) -> str:
    """The console table of ``bench throughput``: one right-aligned row per run."""
    head = [
        f"bench throughput: {res['args']['steps']} steps per run, first "
        f"{res['args']['warmup']} excluded; ratios to v={res['reference_v']}"
    ]
    rows = [[_figures(r)[key] for _, key, _ in CONSOLE_COLUMNS] for r in res["runs"]]
    return format_table(
        [title for title, _, _ in CONSOLE_COLUMNS], rows, [w for _, _, w in CONSOLE_COLUMNS],
        head=head, foot=_score_alpha_lines(res["runs"]),
    )  # fmt: skip


def _score_alpha_lines(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """grpo.off_policy.score_alpha: what alpha's log-prob pass costs per step, inside ``train``."""
    return [
        f"v={r['v']}: grpo.off_policy.score_alpha's log-prob pass "
        f"{r['score_alpha_mean_s']:.3f} s per step "
        f"({100 * r['score_alpha_mean_s'] / r['step_time_mean_s']:.1f}% of a step; in train)"
        for r in runs
        if r.get("score_alpha_mean_s") is not None and r["step_time_mean_s"]
    ]


def throughput_markdown(res: Mapping[str, Any]) -> str:
    a = res["args"]
    ref = res["reference_v"]
    lines = [
        f"Runs: {a['steps']} steps each, first {a['warmup']} excluded (warm-up); "
        f"nproc={a['nproc']}; config={a['config'] or 'embedded defaults'}; overrides: "
        f"`{' '.join(a['overrides']) or '(none)'}`; rounds={a.get('rounds', 1)} (round-robin, "
        f"steps pooled). Ratios are to v={ref}.",
        "",
        "| v | ahead | steps/s | ratio | vs serial | predicted | median ratio of rounds | tokens/s | ratio | syncs (measured) "
        "| s/sync | sync/step "
        "| rollout | reward | logprobs | train | other | step | sync-only ratio | load 1m |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["runs"]:
        f = _figures(r)
        cells = [
            f["v"], f["ahead"], f["steps/s"], f["steps ratio"], _opt(r.get("ahead_speedup")),
            _opt(r.get("ahead_speedup_predicted")),
            _opt(r.get("steps_per_s_ratio_median_of_rounds")), f["tok/s"], f["tok ratio"],
            f"{f['syncs']} ({r['measured_syncs']})", f["s/sync"], f["sync/step"],
            f["rollout"], f["reward"], f["logprobs"], f["train"], f["other"], f["step"],
            f"{r['sync_only_ratio']:.3f}", _load(r),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _opt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _load(r: Mapping[str, Any]) -> str:
    la = r.get("loadavg_1m") or [None, None]
    return " -> ".join("-" if x is None else f"{x:.1f}" for x in la)


def write_throughput_report(res: Mapping[str, Any], out_dir: str | os.PathLike) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [
        plot_throughput(res, out / "throughput_vs_v.png"),
        plot_phases(res, out / "phase_breakdown.png"),
    ]
    md = out / "throughput.md"
    md.write_text("# bench throughput\n\n" + throughput_markdown(res) + "\n")
    files.append(md)
    js = out / "throughput.json"
    js.write_text(json.dumps(res, indent=2, default=str))
    files.append(js)
    return files


def _at(d: Mapping[Any, float], sync_interval: int) -> float:
    """``d[v]``, also after a JSON round trip (int keys become strings)."""
    return d[sync_interval] if sync_interval in d else d[str(sync_interval)]


def plot_projection(p: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Predicted throughput ratio vs v for each sync-cost scenario (7B, 8xH100)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4))
    ax = fig.add_subplot()
    vs = p["vs"]
    styles = ["o-", "s--", "^-.", "v:", "D-", "x--", "+-.", "*:", "h-", "p--", "<-."]
    for i, s in enumerate(p["scenarios"]):
        ax.plot(vs, [_at(s["ratios"], sync_interval) for sync_interval in vs],
                styles[i % len(styles)], ms=4,
                label=f"{s['name']} (S={s['sync_s']:.3g} s)")  # fmt: skip
    ax.plot([10], [1.35], "k*", ms=11, label="paper measured 1.35x")
    ax.set_xlabel("sync period v (steps)")
    ax.set_ylabel("throughput / throughput at v=1")
    ax.set_title("Qwen2.5-7B, 8xH100, vLLM TP=4 colocated: projected ratio", fontsize=9)
    ax.set_xticks(vs)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _save(fig, Path(path))
    return Path(path)


def plot_ahead_timeline(
    r: float,
    t: float,
    s: float,
    sync_interval: int,
    path: str | os.PathLike,
    batch_fixed: float = 0.5,
) -> Path:
    """One sync window, serial vs rollout.ahead = v-1, both placements: the vLLM and trainer
    lanes of ``bench.window_schedule.window_events`` (``r`` rollout, ``t`` train, ``s`` sync
    seconds; ``batch_fixed``: colocated batching share, see projection.py)."""
    from matplotlib.figure import Figure

    cases = [
        ("disaggregated", 0, "disaggregated, serial (ahead=0)"),
        ("disaggregated", sync_interval - 1, f"disaggregated, ahead={sync_interval - 1}"),
        ("colocated", 0, "colocated, serial (ahead=0)"),
        ("colocated", sync_interval - 1, f"colocated, ahead={sync_interval - 1} (one call)"),
    ]
    colors = {"gen": PHASE_COLORS["rollout"], "train": PHASE_COLORS["train"],
              "sync": PHASE_COLORS["sync"]}  # fmt: skip
    fig = Figure(figsize=(8, 4.2))
    ax = fig.add_subplot()
    ticks, labels = [], []
    for i, (placement, ahead, title) in enumerate(cases):
        base = (len(cases) - 1 - i) * 3
        events = window_events(r, t, s, sync_interval, ahead, placement, batch_fixed)
        for lane, label, start, end in events:
            y = base + (1 if lane == "vllm" else 0)
            ax.broken_barh([(start, end - start)], (y + 0.1, 0.8), edgecolor="white",
                           color=colors[label.split()[0]])  # fmt: skip
            if label != "sync":
                ax.text((start + end) / 2, y + 0.5, label.split()[-1], ha="center",
                        va="center", fontsize=6, color="white")  # fmt: skip
        end = max(e[3] for e in events)
        ax.text(end + 0.1, base + 0.5, f"{end:.1f} s", va="center", fontsize=7)
        ticks += [base + 0.5, base + 1.5]
        labels += [f"{title}: trainer", "vLLM"]
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.set_xlabel(f"seconds (model: rollout {r:g} s, train {t:g} s, sync {s:g} s per window)")
    ax.set_title(
        f"One sync window of v={sync_interval} steps: serial vs generated ahead", fontsize=9
    )
    handles = [Figure().add_subplot().bar([0], [0], color=c, label=k)[0] for k, c in colors.items()]
    ax.legend(handles, list(colors), fontsize=7, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    _save(fig, Path(path))
    return Path(path)
