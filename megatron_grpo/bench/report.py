"""Plots and markdown for ``bench throughput`` and ``bench project`` (matplotlib's Agg
canvas through ``metrics.plots._save``; no pyplot, no global backend switch)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_grpo.bench.common import trailing_mean
from megatron_grpo.bench.projection import window_events
from megatron_grpo.metrics.plots import _save, drift_axis_floor

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


def format_table(res: Mapping[str, Any]) -> str:
    """The console table of ``bench throughput``: one right-aligned row per run."""
    lines = [
        f"bench throughput: {res['args']['steps']} steps per run, first "
        f"{res['args']['warmup']} excluded; ratios to v={res['reference_v']}",
        "".join(title.rjust(width) for title, _, width in CONSOLE_COLUMNS),
    ]
    for r in res["runs"]:
        f = _figures(r)
        lines.append("".join(f[key].rjust(width) for _, key, width in CONSOLE_COLUMNS))
    return "\n".join(lines)


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
    files = [plot_throughput(res, out / "throughput_vs_v.png"),
             plot_phases(res, out / "phase_breakdown.png")]  # fmt: skip
    md = out / "throughput.md"
    md.write_text("# bench throughput\n\n" + throughput_markdown(res) + "\n")
    files.append(md)
    js = out / "throughput.json"
    js.write_text(json.dumps(res, indent=2, default=str))
    files.append(js)
    return files


def _at(d: Mapping[Any, float], v: int) -> float:
    """``d[v]``, also after a JSON round trip (int keys become strings)."""
    return d[v] if v in d else d[str(v)]


def plot_projection(p: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Predicted throughput ratio vs v for each sync-cost scenario (7B, 8xH100)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4))
    ax = fig.add_subplot()
    vs = p["vs"]
    styles = ["o-", "s--", "^-.", "v:", "D-", "x--", "+-.", "*:", "h-", "p--", "<-."]
    for i, s in enumerate(p["scenarios"]):
        ax.plot(vs, [_at(s["ratios"], v) for v in vs], styles[i % len(styles)], ms=4,
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


def projection_markdown(p: Mapping[str, Any]) -> str:
    vs = p["vs"]
    lines = [
        "| scenario | S per sync (s) | " + " | ".join(f"v={v}" for v in vs) + " | source |",
        "|---|---|" + "---|" * len(vs) + "---|",
    ]
    for s in p["scenarios"]:
        lines.append(
            f"| {s['name']} | {s['sync_s']:.4g} | "
            + " | ".join(f"{_at(s['ratios'], v):.4f}" for v in vs)
            + f" | {s['source']} |"
        )
    return "\n".join(lines)


def sync_markdown(res: Mapping[str, Any]) -> str:
    """A ``bench sync`` JSON as a table with GB/s: end to end (vLLM's load included) and the
    transport alone (wall minus vLLM's load and post-processing), against the raw flat
    transfer of the same bytes over the same process group in the same run."""
    raw = res["raw"]
    lines = [
        f"{res['model']} ({res['model_params'] / 1e6:.1f}M params), trainer tp={res['train_tp']}"
        f" pp={res['train_pp']} dp={res['train_dp']} -> vLLM tp={res['rollout_tp']} x"
        f"{res['world'] // res['rollout_tp']} engines, sink={res['sink']}, median of "
        f"{res['repeats']}; verified={res['verified']} (transfer bit-exact: "
        f"{res['verified_transfer']})",
        "",
        "| method | MiB moved | wire MiB | seconds | GB/s | transport s | transport GB/s "
        "| transport vs raw |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def row(name: str, d: Mapping[str, Any]) -> str:
        t = d.get("transport_s", d["seconds"])
        gbps = d["bytes"] / d["seconds"] / 1e9 if d["seconds"] else float("nan")
        tgbps = d["bytes"] / t / 1e9 if t else float("nan")
        vs_raw = t / raw["seconds"] if raw["seconds"] else float("nan")
        return (
            f"| {name} | {d['bytes'] / 2**20:.1f} | {d['wire_bytes'] / 2**20:.1f} | "
            f"{d['seconds']:.3f} | {gbps:.3f} | {t:.3f} | {tgbps:.3f} | {vs_raw:.2f}x |"
        )

    for b, d in res["direct_by_bucket"].items():
        lines.append(row(f"direct, bucket {float(b):g} MB", d))
    lines.append(row("baseline gather+bcast", res["baseline"]))
    lines.append(row("raw (1 flat buffer per link)", raw))
    return "\n".join(lines)


# ------------------------------------------------------------------------------ reproduce


def plot_claim(
    claim: Mapping[str, Any], curves: Mapping[str, Mapping[Any, list[float]]],
    path: str | os.PathLike,
) -> Path:  # fmt: skip
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
    ax.set_title(f"Claim {claim['id']}: {claim['title']}\nverdict: {claim['verdict']}",
                 fontsize=8)  # fmt: skip
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
    claim: Mapping[str, Any], sync_curves: Mapping[str, Mapping[Any, Mapping[str, list]]],
    max_drift: float | None, path: str | os.PathLike,
) -> Path:  # fmt: skip
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
        line = top.plot([k for k, _ in pts], [d for _, d in pts], lw=1.2,
                        label=f"{name} (seed {seed})")[0]  # fmt: skip
        at = [(k, d) for k, d in pts if c["synced"][k - 1]]
        top.plot([k for k, _ in at], [d for _, d in at], "o", ms=3, color=line.get_color())
        bottom.step(steps, since, where="mid", lw=1.2,
                    color=line.get_color(), label=name)  # fmt: skip
    if max_drift is not None:
        top.axhline(max_drift, color="gray", ls="--", lw=0.8, label=f"max_drift {max_drift:g}")
    top.set_yscale("log")
    if floors:  # the mismatch right after a sync (~1e-14 on CPU) is drawn on the floor
        top.set_ylim(bottom=min(floors))
    top.set_ylabel("drift: KL(alpha || pi_k) per token")
    top.set_title(f"Claim {claim['id']}: drift and interval since the last sync (dots: syncs)",
                  fontsize=8)  # fmt: skip
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
        lines.append(f"| {name} | {_pm(v['syncs_mean'], v['syncs_std'])} | {vtxt} | "
                     f"{steps - v['syncs_mean']:.1f} | {drift} | "
                     f"{'-' if wall is None else f'{wall:.0f}'} |")  # fmt: skip
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
            lines.append(f"| {k['a']} {rel} {k['b']} | {k['metric']} | {k['verdict']} | "
                         f"{k['reason']} |")  # fmt: skip
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
            files.append(plot_sync_curves(c, sync, _max_drift(res, c), out / f"claim{cid}_sync.png"))  # fmt: skip
    md = out / "reproduce.md"
    md.write_text("# bench reproduce\n\n" + reproduce_markdown(res) + "\n")
    js = out / "reproduce.json"
    js.write_text(json.dumps(res, indent=2, default=str))
    return [*files, md, js]


def plot_ahead_timeline(
    r: float, t: float, s: float, v: int, path: str | os.PathLike, batch_fixed: float = 0.5
) -> Path:
    """One sync window, serial vs rollout.ahead = v-1, both placements: the vLLM and trainer
    lanes of ``bench.projection.window_events`` (``r`` rollout, ``t`` train, ``s`` sync
    seconds; ``batch_fixed``: colocated batching share, see projection.py)."""
    from matplotlib.figure import Figure

    cases = [
        ("disaggregated", 0, "disaggregated, serial (ahead=0)"),
        ("disaggregated", v - 1, f"disaggregated, ahead={v - 1}"),
        ("colocated", 0, "colocated, serial (ahead=0)"),
        ("colocated", v - 1, f"colocated, ahead={v - 1} (one call)"),
    ]
    colors = {"gen": PHASE_COLORS["rollout"], "train": PHASE_COLORS["train"],
              "sync": PHASE_COLORS["sync"]}  # fmt: skip
    fig = Figure(figsize=(8, 4.2))
    ax = fig.add_subplot()
    ticks, labels = [], []
    for i, (placement, ahead, title) in enumerate(cases):
        base = (len(cases) - 1 - i) * 3
        events = window_events(r, t, s, v, ahead, placement, batch_fixed)
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
    ax.set_title(f"One sync window of v={v} steps: serial vs generated ahead", fontsize=9)
    handles = [Figure().add_subplot().bar([0], [0], color=c, label=k)[0] for k, c in colors.items()]
    ax.legend(handles, list(colors), fontsize=7, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    _save(fig, Path(path))
    return Path(path)
