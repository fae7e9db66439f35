"""``bench project``'s text reports (the models: ``projection/model.py``, ``projection/moe.py``)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_grpo.bench.projection.model import GB, GiB
from megatron_grpo.bench.projection.moe import moe_sync_projection


def format_projection(p: Mapping[str, Any]) -> str:
    """``bench project``'s report: the calibration and bytes, the scenarios' ratios per v, the
    trainer layouts, rollout.ahead's 7B schedule, and the gap to the paper's S."""
    out = _calibration_lines(p) + [""] + _scenario_lines(p) + [""] + _layout_lines(p["layouts"])
    sch = p.get("schedule_7b_disaggregated")
    if sch:
        out += ["", *_ahead_schedule_lines(sch)]
    g = p["gap"]
    out += [
        "",
        f"Gap: the paper's S is {g['paper_S_over_verl_nccl']:.0f}x verl's NCCL sync and "
        f"{g['paper_S_over_direct_wire']:.0f}x the bridge's NVLink wire time; 1.10x at v=10 "
        f"needs S >= {g['S_needed_for_1.10x_at_v10']:.2f} s, 1.35x needs "
        f"{g['S_needed_for_1.35x_at_v10']:.2f} s.",
    ]
    return "\n".join(out)


def _calibration_lines(p: Mapping[str, Any]) -> list[str]:
    """S and T_other solved from the paper's two measured it/s, and the bytes per sync."""
    c, a, b = p["calibration"], p["assumptions"], p["bytes"]
    (va, xa), (vb, xb) = a["paper_it_s"]
    return [
        f"Calibration ({a['model']}, {a['gpus']}xH100, vLLM TP={a['rollout_tp']} colocated):",
        f"  1/{xa} = {1 / xa:.3f} s = T_other + S/{va}",
        f"  1/{xb} = {1 / xb:.3f} s = T_other + S/{vb}",
        f"  S = ({1 / xa:.3f} - {1 / xb:.3f}) / (1/{va} - 1/{vb}) = {c['sync_s']:.3f} s per sync;"
        f" T_other = {c['t_other_s']:.3f} s per step "
        f"(sync = {100 * c['sync_share_of_v1_step']:.1f}% of a v={va} step)",
        f"Bytes per sync (bf16, trainer TP={a['trainer_tp']} PP={a['trainer_pp']} "
        f"DP={a['gpus'] // (a['trainer_tp'] * a['trainer_pp'])} -> {b['engines']} engines x "
        f"TP={a['rollout_tp']}): model {b['model_bytes'] / GB:.2f} GB; direct "
        f"{b['direct_total'] / GiB:.2f} GiB ({b['direct_in_process'] / GiB:.2f} in-process, "
        f"busiest rank {b['direct_busiest_rank'] / GiB:.2f} GiB cross); baseline "
        f"{b['baseline_total'] / GiB:.2f} GiB (gather {b['baseline_gather_into_root'] / GiB:.2f}"
        f" + broadcast wire {b['baseline_broadcast_wire'] / GiB:.2f} + root in-process)",
    ]


def _scenario_lines(p: Mapping[str, Any]) -> list[str]:
    """Each scenario's S and its throughput ratio at every v."""
    vs = p["vs"]
    out = [
        f"{'scenario':<46}{'S (s)':>9}"
        + "".join(f"{f'v={sync_interval:g}':>8}" for sync_interval in vs),
    ]
    for s in p["scenarios"]:
        out.append(
            f"{s['name']:<46}{s['sync_s']:>9.3f}"
            + "".join(f"{s['ratios'][sync_interval]:>8.4f}" for sync_interval in vs)
        )
    if p.get("mean_interval") is not None:
        out.append(
            f"(v={p['mean_interval']:g}: the observed mean interval of an adaptive run, "
            "--mean-interval; T_other + S / mean interval)"
        )
    return out


def _layout_lines(layouts: Sequence[Mapping[str, Any]]) -> list[str]:
    """Bytes and wire seconds per trainer layout, direct bridge against the baseline."""
    out = [
        f"{'trainer layout':<18}{'direct GiB':>11}{'busiest':>9}{'baseline GiB':>13}"
        f"{'direct s':>10}{'base s':>9}{'dir v10':>9}{'base v10':>9}"
    ]
    for lay in layouts:
        lb = lay["bytes"]
        out.append(
            f"TP{lay['trainer_tp']} PP{lay['trainer_pp']} DP{lay['trainer_dp']:<9}"
            f"{lb['direct_total'] / GiB:>11.2f}{lb['direct_busiest_rank'] / GiB:>9.2f}"
            f"{lb['baseline_total'] / GiB:>13.2f}{lay['direct_wire_s']:>10.4f}"
            f"{lay['baseline_wire_s']:>9.4f}{lay['direct_ratio_v10']:>9.4f}"
            f"{lay['baseline_ratio_v10']:>9.4f}"
        )
    return out


def _ahead_schedule_lines(sch: Mapping[str, Any]) -> list[str]:
    """rollout.ahead's 7B disaggregated schedule: serial against ahead, per v."""
    out = [
        f"rollout.ahead, 7B disaggregated on 2 nodes (vLLM node + trainer node; R = "
        f"{sch['rollout_s']:.2f} s, T = {sch['train_s']:.2f} s: T_other split "
        f"{sch['rollout_share']:.0%} rollout, an assumption; S = {sch['sync_s']:.2f} s):",
        f"{'v':>4}{'serial s/step':>15}{'ahead s/step':>14}{'serial it/s':>13}"
        f"{'ahead it/s':>12}{'speedup':>9}",
    ]
    for row in sch["rows"]:
        out.append(
            f"{row['v']:>4}{row['serial_step_s']:>15.2f}{row['ahead_step_s']:>14.2f}"
            f"{row['serial_it_s']:>13.4f}{row['ahead_it_s']:>12.4f}{row['speedup']:>9.3f}"
        )
    return out


def format_moe_sync(p: Mapping[str, Any]) -> str:
    """The projection as the table docs/benchmarks.md shows."""
    a = p["assumptions"]
    lo, hi = a["nemo_rl_sync_s"]
    out = [
        f"{a['model']} sync, {a['gpus']}xH100, trainer TP={a['trainer_tp']} EP={a['trainer_ep']}"
        f" DP={a['gpus'] // a['trainer_tp']}, colocated engines; {p['parameters']:,} parameters"
        f" = {p['model_bytes'] / GB:.2f} GB in bf16 per engine; wire time = busiest rank's "
        f"cross-process bytes at {a['nvlink_GBps']:g} GB/s + its in-process bytes at "
        f"{a['hbm_copy_GBps']:g} GB/s",
        "",
        f"{'vLLM':<12}{'engines':>8}{'GiB/sync':>10}{'in-proc':>9}{'cross':>9}"
        f"{'busiest link':>13}{'busiest rank':>13}{'wire (s)':>10}",
    ]
    for r in p["rows"]:
        name = f"TP={r['rollout_tp']}" + (" EP" if r["rollout_ep"] else "")
        out.append(
            f"{name:<12}{r['engines']:>8}{r['bytes_per_sync'] / GiB:>10.2f}"
            f"{r['in_process'] / GiB:>9.2f}{r['cross_process'] / GiB:>9.2f}"
            f"{r['busiest_link'] / GiB:>13.2f}{r['busiest_rank_cross'] / GiB:>13.2f}"
            f"{r['wire_s']:>10.3f}"
        )
    out.append(
        f"NeMo-RL's published refit of {a['model']}: {lo:g}-{hi:g} s (whole refit, "
        "not the wire alone)"
    )
    return "\n".join(out)


def print_moe_sync(json_out: str | None = None) -> int:
    """``bench project --moe``: print the table, write the projection to ``json_out``."""
    p = moe_sync_projection()
    print(format_moe_sync(p))
    if json_out:
        Path(json_out).write_text(json.dumps(p, indent=2))
    return 0
