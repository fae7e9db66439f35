"""``bench sync``'s summary of its ranks' figures and checks, and its console table (the
command: ``bench/sync/run.py``)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from megatron_grpo.bench.common import format_table
from megatron_grpo.bench.sync.args import BenchSyncArgs
from megatron_grpo.models.spec import load_spec

MiB = 1 << 20


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


METHOD_KEYS = (
    "bytes",
    "wire_bytes",
    "local_bytes",
    "seconds",
    "pack_s",
    "transfer_s",
    "unpack_s",
    "load_s",
    "finish_s",
    "handshake_s",
)
"""The figures of a ``SyncReport`` whose median over the repeats a method's summary gives."""


def method_summary(reports: list[dict]) -> dict:
    """One method's repeats (rank 0's merged ``SyncReport`` dicts): medians, the byte counts
    and per-link bytes of the first, and the phase breakdown."""
    d: dict[str, Any] = {k: _median([r[k] for r in reports]) for k in METHOD_KEYS}
    d["bytes"] = int(reports[0]["bytes"])
    d["wire_bytes"] = int(reports[0]["wire_bytes"])
    d["local_bytes"] = int(reports[0]["local_bytes"])
    d["seconds_all"] = [r["seconds"] for r in reports]
    d["first_seconds"] = reports[0]["seconds"]
    d["bytes_per_link"] = reports[0]["bytes_per_link"]
    d["peak_bucket_bytes"] = reports[0]["peak_bucket_bytes"]
    # Disjoint phases summing to ``seconds`` (``SyncStats.breakdown``), median per phase.
    d["breakdown"] = {
        k: _median([r["breakdown"][k] for r in reports]) for k in reports[0]["breakdown"]
    }
    # The transfer alone: wall time minus vLLM's per-tensor load and post-processing.
    d["transport_s"] = _median([r["seconds"] - r["load_s"] - r["finish_s"] for r in reports])
    return d


def checks_ok(c: dict) -> bool:
    """One rank's checks all passed (shards, checksums, parity of direct and baseline)."""
    parts = []
    if "direct" in c:
        d = c["direct"]
        parts.append(d.get("shards_ok", True))
        if "checksums" in d:
            parts.append(d["checksums"]["ok"])
        if "parity" in d:
            parts.append(d["parity"]["ok"])
    if "baseline" in c and "parity" in c["baseline"]:
        parts.append(c["baseline"]["parity"]["ok"])
    return bool(parts) and all(parts)


def transfer_ok(c: dict) -> bool:
    """One rank's direct sync delivered bit-exact shards (and checksums, with an engine)."""
    d = c.get("direct", {})
    return bool(d.get("shards_ok")) and d.get("checksums", {"ok": True})["ok"]


def summarize(a: BenchSyncArgs, per_rank: list[dict], hf_dir: Path) -> dict:
    """The result of ``bench sync`` from every rank's figures: rank 0's timings (the best
    bucket size is ``direct``), the ratios between the methods and every rank's checks."""
    r0 = per_rank[0]
    spec = load_spec(hf_dir)
    by_bucket = {
        str(b): {**method_summary(reps), "bucket_mb": b} for b, reps in r0["direct"].items()
    }
    best = min(by_bucket.values(), key=lambda d: d["seconds"])
    checks = [r["checks"] for r in per_rank]
    raw = method_summary(r0["raw"])
    result = {
        "model": a.model,
        "model_params": spec.num_parameters,
        "train_tp": a.train_tp,
        "train_pp": a.train_pp,
        "train_ep": a.train_ep,
        "train_dp": a.world // (a.train_tp * a.train_pp),
        "rollout_tp": a.rollout_tp,
        "world": a.world,
        "sink": a.sink,
        "repeats": a.repeats,
        "minimal_bytes": r0["minimal_bytes"],
        "direct": best,
        "direct_by_bucket": by_bucket,
        "baseline": method_summary(r0["baseline"]),
        "raw": raw,
        "direct_over_raw": best["seconds"] / raw["seconds"] if raw["seconds"] else None,
        "direct_transport_over_raw": (
            best["transport_s"] / raw["seconds"] if raw["seconds"] else None
        ),
        "baseline_over_direct": method_summary(r0["baseline"])["seconds"] / best["seconds"],
        # The fixed cost over the bytes, and the ratio to what no bridge can avoid: the raw
        # transfer of the same bytes plus vLLM's own post-load processing (the CPU repack).
        "direct_minus_raw_s": best["seconds"] - raw["seconds"],
        "direct_over_floor": best["seconds"] / (raw["seconds"] + best["breakdown"]["vllm_post"])
        if raw["seconds"]
        else None,
        "verified": all(checks_ok(c) for c in checks),
        # Bit-exact delivery alone (shards + vLLM read-back checksums), without the logprob
        # parity, which also depends on Megatron-vs-vLLM forward numerics.
        "verified_transfer": all(transfer_ok(c) for c in checks),
        "checks": checks,
        "setup": [r["setup"] for r in per_rank],
        "plan": r0["plan"],
        "bucket_memory_bytes": r0.get("bucket_memory_bytes"),
    }
    if "vllm_fresh" in r0:
        result["vllm_fresh"] = fresh_summary(per_rank)
        result["vllm_fresh_over_direct"] = result["vllm_fresh"]["seconds"] / best["seconds"]
    return result


def fresh_summary(per_rank: list[dict]) -> dict:
    """vLLM's own reload (``vllm-fresh``): a load is over when its slowest rank is."""
    r0 = per_rank[0]
    per_rep = [
        max(r["vllm_fresh"]["seconds_all"][i] for r in per_rank)
        for i in range(len(r0["vllm_fresh"]["seconds_all"]))
    ]
    return {
        "seconds": _median(per_rep),
        "seconds_all": per_rep,
        "write_s": r0["vllm_fresh"]["write_s"],
        "parity_ok": all(r["vllm_fresh"]["parity"]["ok"] for r in per_rank),
        "parity_max_abs_diff": max(r["vllm_fresh"]["parity"]["max_abs_diff"] for r in per_rank),
    }


SYNC_WIDTHS = (-22, 10, 10, 9, 8, 8, 8, 8, 8)
SYNC_TITLES = ("method", "MiB moved", "wire MiB", "seconds", "pack", "xfer", "unpack", "load",
               "finish")  # fmt: skip


def _method_row(name: str, d: dict) -> list[str]:
    """One method's cells: bytes, wire bytes, seconds and the phases."""
    phases = ("pack_s", "transfer_s", "unpack_s", "load_s", "finish_s")
    cells = [name, f"{d['bytes'] / MiB:.2f}", f"{d['wire_bytes'] / MiB:.2f}", f"{d['seconds']:.4f}"]
    return cells + [f"{d[k]:.4f}" for k in phases]


def sync_table(res: dict) -> str:
    """The console table of a ``bench sync`` result."""
    head = [
        f"bench sync: {res['model']} ({res['model_params'] / 1e6:.1f}M params), trainer "
        f"tp={res['train_tp']} pp={res['train_pp']} dp={res['train_dp']} ep={res.get('train_ep', 1)} -> vLLM tp="
        f"{res['rollout_tp']} x{res['world'] // res['rollout_tp']} engines, sink={res['sink']}, "
        f"median of {res['repeats']}",
        f"minimal bytes: {res['minimal_bytes'] / MiB:.2f} MiB",
    ]
    rows: list[list[str] | str] = [
        _method_row(f"direct (bucket {b} MB)", d) for b, d in res["direct_by_bucket"].items()
    ]
    rows.append(_method_row("baseline (gather+bcast)", res["baseline"]))
    rows.append(_method_row("raw (1 flat buf/link)", res["raw"]))
    if "vllm_fresh" in res:  # a whole-model load: no bytes or phases, its own line
        f = res["vllm_fresh"]
        rows.append(
            f"{'vllm-fresh (HF load)':<22}{'':>10}{'':>10}{f['seconds']:>9.4f}   (+ write "
            f"{f['write_s']:.4f} s on rank 0; parity ok={f['parity_ok']})  "
            f"fresh/direct = {res['vllm_fresh_over_direct']:.2f}x"
        )
    return format_table(SYNC_TITLES, rows, SYNC_WIDTHS, head=head, foot=_sync_foot(res))


def _sync_foot(res: dict) -> list[str]:
    """The direct sync's breakdown, its ratios to raw and baseline, each rank's checks."""
    b = res["direct"]["breakdown"]
    lines = ["direct breakdown (s): " + "  ".join(f"{k} {v:.4f}" for k, v in b.items())]
    lines.append(
        f"direct - raw = {res['direct_minus_raw_s']:.4f} s   direct / (raw + vllm_post) = "
        f"{res['direct_over_floor']:.2f}x"
    )
    lines.append(
        f"direct/raw = {res['direct_over_raw']:.2f}x (transport only "
        f"{res['direct_transport_over_raw']:.2f}x)   baseline/direct = "
        f"{res['baseline_over_direct']:.2f}x   direct bytes == minimal: "
        f"{res['direct']['bytes'] == res['minimal_bytes']}   verified: {res['verified']} "
        f"(transfer bit-exact: {res['verified_transfer']})"
    )
    lines += [_rank_checks_line(r, c) for r, c in enumerate(res["checks"])]
    return lines


def _rank_checks_line(r: int, c: dict) -> str:
    """Rank ``r``'s verification: shards, checksums, log-prob parity before and after."""
    d = c.get("direct", {})
    bits = [f"rank {r}: shards_ok={d.get('shards_ok')}"]
    if "checksums" in d:
        bits.append(f"checksums {d['checksums']['checked']} ok={d['checksums']['ok']}")
    if "parity" in d:
        bits.append(f"parity max|dlogp| direct={d['parity']['max_abs_diff']:.2e}")
    if "parity_before_direct" in c:
        bits.append(f"(before sync {c['parity_before_direct']['max_abs_diff']:.2e})")
    if "parity" in c.get("baseline", {}):
        bits.append(f"baseline={c['baseline']['parity']['max_abs_diff']:.2e}")
    return "  " + ", ".join(bits)
