"""Where the paper's 1.35x comes from: a step-time model of off-policy GRPO at sync period v,
``step_time(v) = T_other + S / v``, calibrated on the paper's two throughputs
(:func:`calibrate`), with candidate sync costs S for the same model and node
(:func:`default_scenarios`; every assumption a named field of :class:`Assumptions`). Pure
Python (plus the GPU-free plan), deterministic, fast. The model, the calibration and the
scenarios: docs/benchmarks.md §3.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from megatron_grpo.bench.projection.window_schedule import schedule_step_time
from megatron_grpo.bridge.plan import build_plan, plan_report
from megatron_grpo.distributed.placement import colocated_engines
from megatron_grpo.layouts.megatron import MegatronLayout
from megatron_grpo.models.shapes import preset_spec
from megatron_grpo.models.spec import megatron_padded_vocab

GB = 1e9
GiB = float(1 << 30)

PAPER_IT_S = {1: 0.02828, 10: 0.03828}
"""Paper's measured training throughput (it/s) for Qwen2.5-7B on 8xH100, vLLM TP=4."""


# ------------------------------------------------------------------------------ algebra


def calibrate(x_a: float, v_a: int, x_b: float, v_b: int) -> tuple[float, float]:
    """(T_other, S) from two throughputs ``x_a`` it/s at ``v_a`` and ``x_b`` at ``v_b``.

    Solves ``1/x = T_other + S/v`` at both points. Raises ValueError naming the inputs when
    the system is singular (v_a == v_b) or the solution is not physical (S < 0 or
    T_other <= 0, i.e. the larger v was not faster, or faster than S/v can explain).
    """
    if v_a == v_b:
        raise ValueError(f"calibrate: v_a == v_b == {v_a}; two different sync periods needed.")
    if x_a <= 0 or x_b <= 0:
        raise ValueError(f"calibrate: throughputs must be > 0, got {x_a} and {x_b} it/s.")
    s = (1.0 / x_a - 1.0 / x_b) / (1.0 / v_a - 1.0 / v_b)
    t_other = 1.0 / x_a - s / v_a
    if s < 0 or t_other <= 0:
        raise ValueError(
            f"calibrate: {x_a} it/s at v={v_a} and {x_b} it/s at v={v_b} give S={s:.4g} s, "
            f"T_other={t_other:.4g} s; a sync cost amortized over v needs S >= 0 and "
            "T_other > 0 (the larger v must be faster, by less than 1/T_other)."
        )
    return t_other, s


def step_time(t_other: float, sync_s: float, sync_interval: float) -> float:
    """Seconds per trainer step when a sync of ``sync_s`` seconds happens every
    ``sync_interval`` steps
    (or every ``sync_interval`` steps on average: an adaptive run's mean interval)."""
    if sync_interval < 1:
        raise ValueError(f"v={sync_interval} must be >= 1.")
    return t_other + sync_s / sync_interval


def throughput_ratio(
    t_other: float, sync_s: float, sync_interval: float, ref_v: float = 1
) -> float:
    """Steps/s at ``sync_interval`` over steps/s at ``ref_v`` (1 when ``sync_s`` is 0; grows
    with v)."""
    return step_time(t_other, sync_s, ref_v) / step_time(t_other, sync_s, sync_interval)


def sync_s_for_ratio(t_other: float, ratio: float, sync_interval: int) -> float:
    """The per-sync cost S that makes ``throughput_ratio(T_other, S, v) == ratio``."""
    if sync_interval == 1:
        raise ValueError("v=1: every S gives ratio 1; pick v > 1.")
    # (T + S) / (T + S/v) = r  ->  S (1 - r/v) = T (r - 1)
    den = 1.0 - ratio / sync_interval
    if den <= 0:
        raise ValueError(
            f"ratio {ratio} >= v={sync_interval} is unreachable (the bound is v as S -> inf)."
        )
    return t_other * (ratio - 1.0) / den


# ------------------------------------------------------------------------------ assumptions


@dataclass(frozen=True)
class Assumptions:
    """Every number the projection uses that was not computed here, with its source."""

    model: str = "Qwen2.5-7B"
    """Shape from ``models.tiny.PRESETS`` (hidden 3584, 28 layers, 28/4 heads, vocab 152064)."""
    gpus: int = 8
    """One 8xH100 SXM node (paper)."""
    trainer_tp: int = 1
    """Trainer layout: TP=1 x DP=8, the closest Megatron layout to the paper's FSDP-style
    data parallel trainer (every rank can hand its colocated vLLM rank its shard in-process;
    an FSDP trainer would first all-gather, which this lower bound leaves out)."""
    trainer_pp: int = 1
    rollout_tp: int = 4
    """vLLM TP=4 colocated (paper): two engines on ranks 0-3 and 4-7."""
    dtype_bytes: int = 2
    """bf16 weights on the wire."""
    nvlink_GBps: float = 450.0
    """H100 SXM NVLink4, per GPU per direction (900 GB/s bidirectional): 15.2 GB in ~34 ms
    (docs/benchmarks.md, "The anchors and the physical limits")."""
    pcie_GBps: float = 63.0
    """PCIe Gen5 x16 usable: 15.2 GB in ~0.24 s (docs/benchmarks.md, same section)."""
    nic_GBps: float = 50.0
    """One 400 Gb/s NIC: 15.2 GB in ~0.30 s (docs/benchmarks.md, same section)."""
    hbm_copy_GBps: float = 1675.0
    """A device-to-device copy on H100 (3.35 TB/s HBM3; a copy reads and writes)."""
    verl_sync_s: tuple[float, float] = (0.55, 0.79)
    """verl, Qwen2.5-7B weight sync on 8xL20: colocated, and over NCCL."""
    nemo_rl_sync_s: float = 5.0
    """NeMo-RL, Llama-3.1-8B refit on 8 GPUs (4.5% of a 112 s step); 8B, not 7B."""
    paper_it_s: tuple[tuple[int, float], ...] = ((1, 0.02828), (10, 0.03828))
    """(v, it/s) pairs measured by the paper."""
    baseline_broadcast: str = "ring"
    """Gather+broadcast baseline on NVLink: NCCL's pipelined ring, ~M / link bandwidth
    for any number of receivers (the best case for the baseline; a naive root-sends-to-each
    broadcast would be (receivers - 1) x slower)."""


def seven_b_disaggregated(
    a: Assumptions | None = None, vs: Sequence[int] = (1, 2, 4, 8, 10), rollout_share: float = 0.5
) -> dict[str, Any]:
    """The 7B prediction for the disaggregated 2-node layout (one node of vLLM engines, one
    of trainer ranks): the paper's calibrated T_other split into rollout R and train T by
    ``rollout_share`` (an assumption: the paper does not publish the split; each phase keeps
    a whole node, as in the colocated run where it has the node in turn), its S per sync, and
    steps/s serial vs ahead = v - 1 for every v."""
    a = a or Assumptions()
    (va, xa), (vb, xb) = a.paper_it_s
    t_other, s = calibrate(xa, va, xb, vb)
    r, t = rollout_share * t_other, (1 - rollout_share) * t_other
    rows = []
    for sync_interval in vs:
        serial = schedule_step_time(r, t, s, sync_interval, 0, "disaggregated")
        ahead = schedule_step_time(r, t, s, sync_interval, sync_interval - 1, "disaggregated")
        rows.append({"v": sync_interval, "serial_step_s": serial, "ahead_step_s": ahead,
                     "serial_it_s": 1 / serial, "ahead_it_s": 1 / ahead,
                     "speedup": serial / ahead})  # fmt: skip
    return {"rollout_s": r, "train_s": t, "sync_s": s, "rollout_share": rollout_share, "rows": rows}


# ------------------------------------------------------------------------------ bytes


@dataclass
class PlanBytes:
    """Bytes of one sync for a layout, from the static plan (direct) and by construction
    (baseline)."""

    model_bytes: int
    """One full copy of the weights (what vLLM holds per engine, summed over its ranks)."""
    engines: int
    vllm_ranks: int
    direct_total: int
    direct_in_process: int
    direct_cross: int
    direct_busiest_rank: int
    """max over ranks of cross-process bytes sent or received (the bottleneck link end)."""
    direct_busiest_in_process: int
    baseline_gather_into_root: int
    baseline_broadcast_wire: int
    """Full tensors to every vLLM rank but the root's own: M x (vLLM ranks - 1)."""
    baseline_total: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_bytes(a: Assumptions) -> PlanBytes:
    """Direct bridge bytes from ``build_plan`` on the preset shape; baseline by construction:
    gather every shard the root (rank 0) does not hold, then broadcast the full model to all
    vLLM ranks (``bridge/baseline.py``)."""
    spec = preset_spec(a.model)
    if a.gpus % (a.trainer_tp * a.trainer_pp) or a.gpus % a.rollout_tp:
        raise ValueError(
            f"gpus({a.gpus}) must be a multiple of trainer tp*pp ({a.trainer_tp}*"
            f"{a.trainer_pp}) and of rollout_tp({a.rollout_tp})."
        )
    dp = a.gpus // (a.trainer_tp * a.trainer_pp)
    layout = MegatronLayout(
        a.trainer_tp,
        a.trainer_pp,
        dp=dp,
        padded_vocab=megatron_padded_vocab(spec.vocab_size, a.trainer_tp),
    )
    engines = colocated_engines(a.gpus, a.rollout_tp)
    rep = plan_report(build_plan(spec, layout, a.rollout_tp, engines, a.dtype_bytes))
    links = rep.bytes_per_link
    in_proc: dict[int, int] = {}
    for (s, d), n in links.items():
        if s == d:
            in_proc[s] = in_proc.get(s, 0) + n
    busiest = max(
        [*rep.sent_per_rank.values(), *rep.received_per_rank.values(), 0],
    )
    model_bytes = spec.num_parameters * a.dtype_bytes
    n_vllm = len(engines) * a.rollout_tp
    root_share = 1.0 / (a.trainer_tp * a.trainer_pp)
    gather = int(round(model_bytes * (1.0 - root_share)))
    bcast = model_bytes * (n_vllm - 1)
    return PlanBytes(
        model_bytes=model_bytes, engines=len(engines), vllm_ranks=n_vllm,
        direct_total=rep.bytes_per_sync, direct_in_process=rep.in_process_bytes,
        direct_cross=rep.cross_process_bytes, direct_busiest_rank=busiest,
        direct_busiest_in_process=max(in_proc.values(), default=0),
        baseline_gather_into_root=gather, baseline_broadcast_wire=bcast,
        baseline_total=gather + bcast + model_bytes,
    )  # fmt: skip


def direct_wire_s(b: PlanBytes, link_GBps: float, copy_GBps: float) -> float:
    """Every link works at once: the busiest rank's cross-process bytes over its link, plus
    its in-process copies (they run on the same device, not overlapped here)."""
    return b.direct_busiest_rank / (link_GBps * GB) + b.direct_busiest_in_process / (copy_GBps * GB)


def baseline_wire_s(b: PlanBytes, link_GBps: float, copy_GBps: float) -> float:
    """Gather into the root over its one link, then a pipelined ring broadcast of the full
    model (~M / link bandwidth), plus the root's own in-process copy."""
    return (
        b.baseline_gather_into_root / (link_GBps * GB)
        + b.model_bytes / (link_GBps * GB)
        + b.model_bytes / b.vllm_ranks / (copy_GBps * GB)
    )


# ------------------------------------------------------------------------------ scenarios


@dataclass
class Scenario:
    name: str
    sync_s: float
    """Per-sync cost S (seconds) in this scenario."""
    source: str
    """Where S comes from."""
    ratios: dict[float, float] = field(default_factory=dict)


def default_scenarios(a: Assumptions, b: PlanBytes, s_paper: float) -> list[Scenario]:
    m = b.model_bytes
    direct = direct_wire_s(b, a.nvlink_GBps, a.hbm_copy_GBps)
    base = baseline_wire_s(b, a.nvlink_GBps, a.hbm_copy_GBps)
    residual = max(0.0, s_paper - base)
    fsdp = m * (a.gpus - 1) / a.gpus / (a.nvlink_GBps * GB) + direct
    return [
        Scenario("paper (implied S)", s_paper,
                 "solved from the paper's two throughputs (calibrate)"),
        Scenario("direct bridge, wire only (NVLink4)", direct,
                 f"busiest rank {b.direct_busiest_rank / GiB:.2f} GiB cross-process at "
                 f"{a.nvlink_GBps:g} GB/s + {b.direct_busiest_in_process / GiB:.2f} GiB "
                 f"in-process at {a.hbm_copy_GBps:g} GB/s"),
        Scenario("baseline gather+bcast, wire only (NVLink4)", base,
                 f"gather {b.baseline_gather_into_root / GiB:.2f} GiB into rank 0 + ring "
                 f"broadcast of {m / GiB:.2f} GiB at {a.nvlink_GBps:g} GB/s"),
        Scenario("FSDP trainer: all-gather + direct", fsdp,
                 f"each rank all-gathers {(a.gpus - 1) / a.gpus:.3f} of {m / GB:.2f} GB at "
                 f"{a.nvlink_GBps:g} GB/s, then copies its vLLM shard in-process"),
        Scenario("direct bridge + paper's non-wire overhead", direct + residual,
                 f"bridge wire + ({s_paper:.2f} - baseline wire {base:.3f}) s of reload, "
                 "wake/sleep, cache reset kept"),
        Scenario("verl-like sync (colocated)", a.verl_sync_s[0], "verl Qwen2.5-7B, 8xL20"),
        Scenario("verl-like sync (NCCL)", a.verl_sync_s[1], "verl Qwen2.5-7B, 8xL20"),
        Scenario("NeMo-RL-like refit", a.nemo_rl_sync_s, "NeMo-RL Llama-3.1-8B, 8 GPUs"),
        Scenario("full model over PCIe Gen5 x16", m / (a.pcie_GBps * GB),
                 f"{m / GB:.2f} GB at {a.pcie_GBps:g} GB/s"),
        Scenario("full model over one 400G NIC", m / (a.nic_GBps * GB),
                 f"{m / GB:.2f} GB at {a.nic_GBps:g} GB/s"),
        Scenario("full model over NVLink4", m / (a.nvlink_GBps * GB),
                 f"{m / GB:.2f} GB at {a.nvlink_GBps:g} GB/s"),
    ]  # fmt: skip


def project(
    a: Assumptions | None = None,
    vs: Sequence[float] = (1, 2, 5, 10, 20),
    layouts: Sequence[tuple[int, int]] = ((1, 1), (2, 1), (4, 1)),
    mean_interval: float | None = None,
) -> dict[str, Any]:
    """The whole projection: calibration, bytes per trainer layout, scenarios, ratios.
    ``mean_interval``: an adaptive run's observed mean interval, projected as one more v."""
    a = a or Assumptions()
    if mean_interval is not None:
        if not mean_interval >= 1:
            raise ValueError(
                f"--mean-interval {mean_interval}: an interval is >= 1 step (give "
                "summary.json's mean_sync_interval of an adaptive run)."
            )
        vs = sorted({*vs, mean_interval})
    (va, xa), (vb, xb) = a.paper_it_s
    t_other, s_paper = calibrate(xa, va, xb, vb)
    b = plan_bytes(a)
    scenarios = default_scenarios(a, b, s_paper)
    for sc in scenarios:
        sc.ratios = {
            sync_interval: throughput_ratio(t_other, sc.sync_s, sync_interval)
            for sync_interval in vs
        }
    by_layout = [_layout_projection(a, b, t_other, tp, pp) for tp, pp in layouts]
    return {
        "assumptions": asdict(a),
        "calibration": {
            "equations": [f"1/{xa} = T_other + S/{va}", f"1/{xb} = T_other + S/{vb}"],
            "t_other_s": t_other,
            "sync_s": s_paper,
            "step_s": {va: 1 / xa, vb: 1 / xb},
            "sync_share_of_v1_step": s_paper / (1 / xa),
            "check_it_s": {
                va: 1 / step_time(t_other, s_paper, va),
                vb: 1 / step_time(t_other, s_paper, vb),
            },
        },
        "bytes": b.to_dict(),
        "scenarios": [asdict(s) for s in scenarios],
        "layouts": by_layout,
        "vs": list(vs),
        "mean_interval": mean_interval,
        "schedule_7b_disaggregated": seven_b_disaggregated(a),
        "gap": {
            "paper_S_over_verl_nccl": s_paper / a.verl_sync_s[1],
            "paper_S_over_direct_wire": s_paper / scenarios[1].sync_s,
            "S_needed_for_1.10x_at_v10": sync_s_for_ratio(t_other, 1.10, 10),
            "S_needed_for_1.35x_at_v10": sync_s_for_ratio(t_other, 1.35, 10),
        },
    }


def _layout_projection(
    a: Assumptions, b: PlanBytes, t_other: float, tp: int, pp: int
) -> dict[str, Any]:
    """Trainer layout ``tp`` x ``pp``: its bytes per sync, the direct bridge's and the
    baseline's wire seconds, and their throughput ratios at v=10."""
    la = Assumptions(**{**asdict(a), "trainer_tp": tp, "trainer_pp": pp})
    lb = b if (tp, pp) == (a.trainer_tp, a.trainer_pp) else plan_bytes(la)
    d = direct_wire_s(lb, a.nvlink_GBps, a.hbm_copy_GBps)
    bw = baseline_wire_s(lb, a.nvlink_GBps, a.hbm_copy_GBps)
    return {
        "trainer_tp": tp,
        "trainer_pp": pp,
        "trainer_dp": a.gpus // (tp * pp),
        "bytes": lb.to_dict(),
        "direct_wire_s": d,
        "baseline_wire_s": bw,
        "direct_ratio_v10": throughput_ratio(t_other, d, 10),
        "baseline_ratio_v10": throughput_ratio(t_other, bw, 10),
    }


def calibrate_from_throughput(res: Mapping[str, Any]) -> dict[str, Any]:
    """Check the model on a measured ``bench throughput`` result: T_other and S from the
    reference run alone (its non-sync step time, its mean seconds per sync), then the
    predicted ratio for every other v against the measured one."""
    serial = [r for r in res["runs"] if r.get("ahead", 0) == 0]  # this model has no ahead
    ref = min(serial, key=lambda r: r["v"])
    s = ref["sync_time_mean_s"] or 0.0
    t_other = ref["step_time_mean_s"] - ref["sync_amortized_s"]
    rows = []
    for r in serial:
        rows.append({
            "v": r["v"], "measured_ratio": r["steps_per_s_ratio"],
            "predicted_ratio": throughput_ratio(t_other, s, r["v"], ref["v"]),
        })  # fmt: skip
    return {"reference_v": ref["v"], "t_other_s": t_other, "sync_s": s, "rows": rows}
