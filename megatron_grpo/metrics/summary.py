"""End-of-run summary: what the run did, where the time went, and what syncing every v saved.

The saving is an estimate from the run's own measurements: had the trainer pushed its
weights after every step instead of every v-th (or, ``sync.mode=adaptive``, instead of when
the drift called for it), it would have done ``steps - num_syncs`` more syncs, counted from
the syncs the run actually made (the ``synced`` rows), each costing the mean measured sync time and bytes. It leaves out second-order
effects (vLLM's cache reset after a reload, memory wake-up in colocated mode), so it is a
lower bound on the real saving. The paper's measured ratio, for reference: 1.35x for
Qwen2.5-7B at v=10 (Mroueh et al., arXiv 2505.22257).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_grpo.metrics.schema import PHASES

SUMMARY_FILE = "summary.json"
WINDOW = 20
"""Steps averaged at each end of the run for the reward trend."""


def _values(rows: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    out = []
    for row in rows:
        v = row.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append(float(v))
    return out


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize(
    rows: Sequence[Mapping[str, Any]], sync_interval: int, sync_mode: str = "fixed"
) -> dict[str, Any]:
    """The summary as a JSON-able dict (the content of ``summary.json``).

    ``rows`` are metrics.jsonl lines (dicts with at least ``step``), in step order.
    ``sync_mode``: ``sync.mode`` (``sync_interval``, v, is only a label in adaptive mode).
    """
    if sync_interval < 1:
        raise ValueError(f"sync_interval={sync_interval} must be >= 1 (it is sync.interval, v).")
    n = len(rows)
    out: dict[str, Any] = {"steps": n, "sync_interval": sync_interval, "sync_mode": sync_mode}
    if n == 0:
        return out
    out["first_step"] = rows[0]["step"]
    out["last_step"] = rows[-1]["step"]

    step_times = _values(rows, "time_step")
    wall = _values(rows, "wall_s")
    out["wall_time_s"] = wall[-1] if wall else (sum(step_times) if step_times else None)
    out["step_time_total_s"] = sum(step_times) if step_times else None

    rewards = _values(rows, "reward_mean")
    # Two windows that do not overlap: on a short run, each half of it (a run of one step
    # has no second window: reward_last is None and the line gives the one mean).
    w = min(WINDOW, len(rewards) // 2) or len(rewards)
    out["reward_window"] = w
    out["reward_first"] = _mean(rewards[:w])
    out["reward_last"] = _mean(rewards[-w:]) if len(rewards) >= 2 else None

    synced = [r for r in rows if r.get("synced")]
    out.update(_sync_stats(rows, synced))
    drifts = _values(rows, "drift")
    out["drift_mean"] = _mean(drifts)
    out["drift_max"] = max(drifts) if drifts else None
    out.update(_ratio_parts(rows))
    mismatch = _values(rows, "routing_mismatch")
    out["routing_mismatch_mean"] = _mean(mismatch)
    out["routing_mismatch_max"] = max(mismatch) if mismatch else None
    out["phase_time_mean_s"] = _phase_means(rows, _values(synced, "time_sync"), step_times)

    lags = _values(rows, "lag")
    out["lag_mean"] = _mean(lags)
    out["lag_max"] = int(max(lags)) if lags else None
    out["skipped_nan"] = sum(1 for r in rows if r.get("skipped_nan"))
    out["tokens_per_s_mean"] = _mean(_values(rows, "tokens_per_s"))
    out["sync_every_v_saving"] = _sync_every_v_saving(
        n, len(synced), out["sync_time_mean_s"], out["sync_bytes_mean"], step_times
    )
    return out


def _sync_stats(
    rows: Sequence[Mapping[str, Any]], synced: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """The syncs the run made (its ``synced`` rows): how many, their bytes and seconds."""
    sync_times = _values(synced, "time_sync")
    sync_bytes = _values(synced, "sync_bytes")
    return {
        "num_syncs": len(synced),
        "sync_bytes_total": int(sum(sync_bytes)),
        "sync_time_total_s": sum(sync_times),
        "sync_time_mean_s": _mean(sync_times),
        "sync_bytes_mean": _mean(sync_bytes),
        # Steps per sync actually made: v in fixed mode (up to the run's ragged end), the
        # observed mean interval in adaptive mode (what `plan --mean-interval` takes).
        "mean_sync_interval": len(rows) / len(synced) if synced else None,
    }


def _phase_means(
    rows: Sequence[Mapping[str, Any]], sync_times: Sequence[float], step_times: Sequence[float]
) -> dict[str, float | None]:
    """Mean seconds per step of each phase; time_sync counts 0 on steps that did not sync."""
    n = len(rows)
    phase_means: dict[str, float | None] = {}
    for phase in PHASES:
        if phase == "sync":
            phase_means[phase] = (sum(sync_times) / n) if sync_times else None
        else:
            phase_means[phase] = _mean(_values(rows, f"time_{phase}"))
    phase_means["step"] = _mean(step_times)
    return phase_means


def _sync_every_v_saving(
    n: int,
    num_syncs: int,
    sync_time_mean_s: float | None,
    sync_bytes_mean: float | None,
    step_times: Sequence[float],
) -> dict[str, Any]:
    """What syncing every v saved against syncing every step (see the module docstring)."""
    avoided = n - num_syncs
    saving: dict[str, Any] = {"avoided_syncs": avoided}
    if sync_time_mean_s is None or not step_times:
        saving["note"] = "no timed sync or no time_step in this run: nothing to estimate from"
        return saving
    saved_s = avoided * sync_time_mean_s
    actual_s = sum(step_times)
    every_step_s = actual_s + saved_s
    saving.update(
        saved_time_s=saved_s,
        saved_bytes=int(avoided * (sync_bytes_mean or 0)),
        steps_per_s=n / actual_s if actual_s > 0 else None,
        steps_per_s_if_every_step=n / every_step_s if every_step_s > 0 else None,
        throughput_ratio=every_step_s / actual_s if actual_s > 0 else None,
    )
    return saving


def _ratio_parts(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """grpo.off_policy.score_alpha: each part's largest |log-ratio| and KL over the run (mean and
    max of the steps' values), and the mean fraction of tokens / sequences TIS touched; {} when the
    run did not split the ratio."""
    out: dict[str, Any] = {}
    for part in ("numerics", "staleness"):
        kl, big = _values(rows, f"{part}_kl"), _values(rows, f"{part}_max_abs")
        if kl:
            out.update({f"{part}_kl_mean": _mean(kl), f"{part}_kl_max": max(kl),
                        f"{part}_max_abs": max(big) if big else None})  # fmt: skip
    for key in ("tis_tokens_frac", "tis_seqs_frac", "tis_mixed_tokens_frac", "tis_mixed_seqs_frac"):
        if vals := _values(rows, key):
            out[f"{key}_mean"] = _mean(vals)
    return out


def _ratio_parts_line(s: Mapping[str, Any]) -> str | None:
    if s.get("staleness_kl_mean") is None:
        return None
    line = (
        f"ratio pi_k/alpha_vLLM split (grpo.off_policy.score_alpha): staleness KL mean "
        f"{s['staleness_kl_mean']:.3g} (max {s['staleness_kl_max']:.3g}), numerics KL mean "
        f"{s['numerics_kl_mean']:.3g}, max |log-ratio| staleness "
        f"{_fmt(s['staleness_max_abs'], '.3g')}, numerics {_fmt(s['numerics_max_abs'], '.3g')}"
    )
    if s.get("tis_tokens_frac_mean") is not None:
        line += (
            f"; TIS touched {100 * s['tis_tokens_frac_mean']:.2f}% of tokens, "
            f"{100 * s['tis_seqs_frac_mean']:.2f}% of sequences (on the mixed ratio "
            f"{100 * s['tis_mixed_tokens_frac_mean']:.2f}%, "
            f"{100 * s['tis_mixed_seqs_frac_mean']:.2f}%)"
        )
    return line


def _fmt(x: float | None, spec: str = ".4g") -> str:
    return "n/a" if x is None else format(x, spec)


def _fmt_bytes(b: float | None) -> str:
    if b is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(b) < 1024 or unit == "GiB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{int(b)} B"
        b /= 1024
    return f"{b:.1f} TiB"


def _reward_line(s: Mapping[str, Any]) -> str:
    if s.get("reward_last") is None:
        return f"reward mean: {_fmt(s.get('reward_first'))} (too few steps to compare)"
    return (
        f"reward mean: first {s['reward_window']} steps {_fmt(s['reward_first'])} -> "
        f"last {s['reward_window']} steps {_fmt(s['reward_last'])}"
    )


def format_summary(s: Mapping[str, Any]) -> str:
    """Human-readable lines of a ``summarize`` dict."""
    if not s.get("steps"):
        return "summary: no steps logged."
    lines = [
        f"steps {s['first_step']}..{s['last_step']} ({s['steps']} logged), "
        f"wall time {_fmt(s['wall_time_s'], '.1f')} s",
        _reward_line(s),
        f"syncs ({_schedule(s)}): {s['num_syncs']}, {_fmt_bytes(s['sync_bytes_total'])} "
        f"sent, {_fmt(s['sync_time_mean_s'], '.3f')} s per sync",
        "mean time per step: "
        + ", ".join(f"{k} {_fmt(v, '.3f')} s" for k, v in s["phase_time_mean_s"].items()),
        f"policy lag: mean {_fmt(s['lag_mean'], '.2f')}, max {_fmt(s['lag_max'], 'd')}; "
        f"skipped (non-finite) steps: {s['skipped_nan']}",
    ]
    if s.get("drift_mean") is not None:
        lines.append(
            f"drift of pi_k from the served policy (per-token KL): mean "
            f"{s['drift_mean']:.3g}, max {s['drift_max']:.3g}"
        )
    if parts := _ratio_parts_line(s):
        lines.append(parts)
    if s.get("routing_mismatch_mean") is not None:
        lines.append(
            f"MoE routings where the trainer's router differs from vLLM's "
            f"(rollout.routing_replay): mean {s['routing_mismatch_mean']:.3g}, max "
            f"{s['routing_mismatch_max']:.3g}"
        )
    sv = s["sync_every_v_saving"]
    what = "sync every v" if s.get("sync_mode", "fixed") == "fixed" else "adaptive sync"
    if "note" in sv:
        lines.append(f"{what} vs every step: {sv['note']}")
    else:
        lines.append(
            f"{what} vs every step: {sv['avoided_syncs']} syncs avoided, saving "
            f"~{sv['saved_time_s']:.2f} s and {_fmt_bytes(sv['saved_bytes'])}; estimated "
            f"throughput {_fmt(sv['steps_per_s'], '.4g')} vs {_fmt(sv['steps_per_s_if_every_step'], '.4g')}"
            f" steps/s = {_fmt(sv['throughput_ratio'], '.3f')}x"
        )
    return "\n".join(lines)


def _schedule(s: Mapping[str, Any]) -> str:
    if s.get("sync_mode", "fixed") == "fixed":
        return f"v={s['sync_interval']}"
    return f"adaptive, mean interval {_fmt(s.get('mean_sync_interval'), '.2f')} steps"


def summary(rows: Sequence[Mapping[str, Any]], sync_interval: int, sync_mode: str = "fixed") -> str:
    """The end-of-run summary text the trainer prints."""
    return format_summary(summarize(rows, sync_interval, sync_mode))


def write_summary(
    run_dir: str | os.PathLike,
    rows: Sequence[Mapping[str, Any]],
    sync_interval: int,
    sync_mode: str = "fixed",
) -> dict[str, Any]:
    """Write ``RUN_DIR/summary.json`` (atomically) and return the summary dict."""
    s = summarize(rows, sync_interval, sync_mode)
    path = Path(run_dir) / SUMMARY_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(s, indent=2) + "\n")
    os.replace(tmp, path)
    return s
