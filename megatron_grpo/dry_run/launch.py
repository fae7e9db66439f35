"""Build and check the whole plan of a launch: ranks, parallel sizes, memory, sync bytes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_grpo.bridge.plan import PlanReport, build_plan, plan_report
from megatron_grpo.config.schema import Config, ConfigError
from megatron_grpo.distributed.placement import RankPlacement, place_ranks
from megatron_grpo.distributed.validate import validate_parallel
from megatron_grpo.dry_run.budget import TokenBudget, resolve_token_budget
from megatron_grpo.dry_run.memory import (
    DTYPE_BYTES,
    GIB,
    MemoryReport,
    distributed_optimizer_on,
    estimate_memory,
    kv_bytes_per_token,
    plan_dtype,
)
from megatron_grpo.layouts import vllm as vl
from megatron_grpo.layouts.megatron import MegatronLayout
from megatron_grpo.models.spec import ModelSpec, megatron_padded_vocab


class PlanError(ConfigError):
    """The launch cannot work; the message names the values and the fix (one line)."""


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass
class LaunchPlan:
    nodes: int
    gpus_per_node: int
    gpu_memory_bytes: int
    model: str
    spec: ModelSpec
    ranks: RankPlacement
    tp: int
    pp: int
    dp: int
    vpp: int | None
    rollout_tp: int
    dtype: str
    recompute: bool
    memory: MemoryReport
    sync: PlanReport
    cross_node_sync_bytes: int
    warnings: list[str] = field(default_factory=list)
    budget: TokenBudget | None = None
    """The packed micro-batch's token budget the trainer would use (``dry_run.budget``)."""
    max_model_len: int = 0
    rollout: Any = None
    """The rollout config section (sleep and offload keys) the memory phases assume."""
    sync_interval: float | None = None
    cp: int = 1
    """Context-parallel ranks per DP replica (``parallel.cp``)."""
    """Steps per sync: sync.interval (fixed), or the observed mean interval of an adaptive
    run (``plan --mean-interval``); None for adaptive without one."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def to_json(self) -> dict[str, Any]:
        peak = self.memory.peak
        return {
            "world_size": self.world_size,
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "model": self.model,
            "num_parameters": self.spec.num_parameters,
            "placement": self.ranks.placement,
            "train_ranks": self.ranks.train_ranks,
            "rollout_ranks": self.ranks.rollout_ranks,
            "engines": self.ranks.engines,
            "parallel": {
                "tp": self.tp,
                "pp": self.pp,
                "cp": self.cp,
                "dp": self.dp,
                "vpp": self.vpp,
            },
            "rollout_tp": self.rollout_tp,
            "dtype": self.dtype,
            "recompute": self.recompute,
            "micro_batch_tokens": self.budget.tokens if self.budget else None,
            "micro_batch_tokens_bound": self.budget.bound if self.budget else None,
            "micro_batch_tokens_why": self.budget.why if self.budget else None,
            "memory_per_gpu_bytes": peak.to_dict(),
            "memory_per_gpu_role": peak.role,
            "memory_by_role_bytes": {r: m.to_dict() for r, m in self.memory.per_role.items()},
            "memory_phases_bytes": peak.phases,
            "kv_cache_needed_bytes": self.memory.kv_cache_needed,
            "sequences_per_engine": self.memory.sequences_per_engine,
            "sync_bytes_per_sync": self.sync.bytes_per_sync,
            "sync_interval_steps": self.sync_interval,
            "sync_bytes_per_step": (
                self.sync.bytes_per_sync / self.sync_interval if self.sync_interval else None
            ),
            "sync_in_process_bytes": self.sync.in_process_bytes,
            "sync_cross_process_bytes": self.sync.cross_process_bytes,
            "sync_cross_node_bytes": self.cross_node_sync_bytes,
            "sync_busiest_sender_bytes": self.sync.max_sent,
            "sync_bytes_per_link": {
                f"{s}->{d}": n for (s, d), n in sorted(self.sync.bytes_per_link.items())
            },
            "warnings": self.warnings,
        }

    def _dance(self) -> str:
        r = self.rollout
        sleep = f"vLLM sleep level {r.sleep_level}" if r.sleep_between_rollouts else "no sleep"
        return f"{sleep}, trainer_offload={r.trainer_offload}"

    def table(self, max_links: int = 16) -> str:
        """The plan as ``megatron-grpo plan`` prints it."""
        lines = self._layout_lines()
        lines += ["", "memory per GPU (GiB)", *self._memory_lines()]
        lines += ["", *self._sync_lines(max_links)]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def _layout_lines(self) -> list[str]:
        """The model, cluster, placement, trainer layout, micro-batch and vLLM engines."""
        r = self.ranks
        return [
            f"model        {self.model}: {_count(self.spec.num_parameters)} parameters, "
            f"{self.dtype}",
            f"cluster      {self.nodes} node(s) x {self.gpus_per_node} GPU(s) = world "
            f"{self.world_size}, {self.gpu_memory_bytes / GIB:.0f} GiB per GPU",
            f"placement    {r.placement}: train ranks {_ranges(r.train_ranks)}, rollout ranks "
            f"{_ranges(r.rollout_ranks)}",
            f"trainer      tp={self.tp} pp={self.pp}"
            + (f" cp={self.cp}" if self.cp > 1 else "")
            + f" dp={self.dp}"
            + (f" vpp={self.vpp}" if self.vpp else "")
            + f", recompute={'full' if self.recompute else 'none'}",
            *([f"micro-batch  {self.budget.line()}"] if self.budget else []),
            f"vLLM         {len(r.engines)} engine(s) of tp={self.rollout_tp}: "
            + "; ".join(_ranges(e) for e in r.engines[:8])
            + (" ..." if len(r.engines) > 8 else ""),
        ]

    def _memory_lines(self) -> list[str]:
        """Each role's memory components and peak, the colocated phases, the KV cache."""
        mem = self.memory
        roles = list(mem.per_role.values())
        lines = [f"  {'component':<14}" + "".join(f"{m.role:>15}" for m in roles)]
        for key in roles[0].components:
            lines.append(
                f"  {key:<14}" + "".join(f"{m.components[key] / GIB:>15.2f}" for m in roles)
            )
        lines.append(f"  {'total (peak)':<14}" + "".join(f"{m.total / GIB:>15.2f}" for m in roles))
        for m in roles:
            if m.phases:
                lines.append(
                    f"  colocated phases ({self._dance()}): "
                    + ", ".join(f"{k} {v / GIB:.2f}" for k, v in m.phases.items())
                    + f"; peak in {m.peak_phase}"
                )
        lines.append(
            f"  KV cache needed per engine: {_gib(mem.kv_cache_needed)} "
            f"({mem.sequences_per_engine} sequences x {self.max_model_len} tokens); "
            f"reserved {_gib(mem.kv_cache_reserved)}"
        )
        return lines

    def _sync_lines(self, max_links: int) -> list[str]:
        """The bridge plan's bytes per sync and its ``max_links`` largest links."""
        s = self.sync
        if self.sync_interval:
            every = f"every {self.sync_interval:g} steps"
            per_step = f"; per step {_gib(int(s.bytes_per_sync / self.sync_interval))}"
        else:
            every = "adaptive: --mean-interval gives the bytes per step"
            per_step = ""
        lines = [
            f"weight sync (bridge plan, {every})",
            f"  per sync {_gib(s.bytes_per_sync)}: in-process {_gib(s.in_process_bytes)}, "
            f"cross-process {_gib(s.cross_process_bytes)}, cross-node "
            f"{_gib(self.cross_node_sync_bytes)}, busiest sender {_gib(s.max_sent)}{per_step}",
            f"  {s.num_copies} copies into {s.num_dst_tensors} vLLM shards over "
            f"{len(s.bytes_per_link)} links",
        ]
        links = sorted(s.bytes_per_link.items(), key=lambda kv: (-kv[1], kv[0]))
        for (src, dst), n in sorted(links[:max_links]):
            kind = (
                "in-process"
                if src == dst
                else (
                    "cross-node"
                    if src // self.gpus_per_node != dst // self.gpus_per_node
                    else "intra-node"
                )
            )
            lines.append(f"  link {src:>3} -> {dst:<3} {n / GIB:8.3f} GiB  {kind}")
        if len(links) > max_links:
            lines.append(f"  ... {len(links) - max_links} smaller links (see --json)")
        return lines


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _ranges(ranks: list[int]) -> str:
    if not ranks:
        return "none"
    out, start, prev = [], ranks[0], ranks[0]
    for x in ranks[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(out)


def build_launch_plan(
    cfg: Config,
    spec: ModelSpec,
    *,
    nodes: int,
    gpus_per_node: int,
    gpu_memory_gb: float = 80.0,
    model: str = "",
    recompute: bool = False,
    mean_interval: float | None = None,
) -> LaunchPlan:
    """Check a launch without GPUs; raise PlanError (one line) when it cannot work.
    ``mean_interval``: steps per sync observed in an adaptive run (summary.json's
    ``mean_sync_interval``); it replaces sync.interval in the bytes per step."""
    if nodes < 1 or gpus_per_node < 1:
        raise PlanError(f"--nodes({nodes}) and --gpus-per-node({gpus_per_node}) must be >= 1.")
    if mean_interval is not None and not mean_interval >= 1:
        raise PlanError(
            f"--mean-interval {mean_interval}: an interval is >= 1 step (give "
            "summary.json's mean_sync_interval of an adaptive run)."
        )
    if mean_interval is None and cfg.sync.mode == "fixed":
        mean_interval = float(cfg.sync.interval)
    ranks, dp, warnings = _place(cfg, spec, nodes * gpus_per_node, gpus_per_node)
    p, r = cfg.parallel, cfg.rollout
    engines = len(ranks.engines)
    capacity = int(gpu_memory_gb * GIB)
    colocated = ranks.placement == "colocated"
    budget = resolve_token_budget(
        spec, cfg, dp=dp, colocated=colocated, capacity_bytes=capacity, recompute=recompute
    )
    mem = estimate_memory(
        spec, cfg, dp=dp, num_engines=engines, colocated=colocated, capacity_bytes=capacity,
        recompute=recompute, budget=budget.tokens,
    )  # fmt: skip
    _check_memory(mem, capacity, gpu_memory_gb, cfg, spec, warnings, budget)
    dtype = plan_dtype(cfg)
    layout = MegatronLayout(  # CP ranks hold the same weights: dp x cp replicas (bridge)
        p.tp, p.pp, p.vpp or 1, dp * p.cp,
        padded_vocab=megatron_padded_vocab(spec.vocab_size, p.tp, cfg.model.make_vocab_size_divisible_by),
        ep=p.ep,
    )  # fmt: skip
    sync_plan = build_plan(
        spec, layout, r.tp, ranks.engines, DTYPE_BYTES[dtype], rollout_ep=r.expert_parallel
    )
    report = plan_report(sync_plan)
    cross_node = sum(
        n for (s, d), n in report.bytes_per_link.items() if s // gpus_per_node != d // gpus_per_node
    )
    plan = LaunchPlan(
        nodes=nodes, gpus_per_node=gpus_per_node, gpu_memory_bytes=capacity, model=model,
        spec=spec, ranks=ranks, tp=p.tp, pp=p.pp, dp=dp, vpp=p.vpp, rollout_tp=r.tp, cp=p.cp,
        dtype=dtype, recompute=recompute or cfg.model.recompute == "full", memory=mem, sync=report,
        cross_node_sync_bytes=cross_node, warnings=warnings, budget=budget,
        max_model_len=r.max_model_len,
        rollout=r, sync_interval=mean_interval,
    )  # fmt: skip
    return plan


def _place(
    cfg: Config, spec: ModelSpec, world: int, gpus_per_node: int
) -> tuple[RankPlacement, int, list[str]]:
    """Which ranks train and serve, the trainer's DP size, and the cluster shape's
    warnings; raise PlanError when the placement cannot work on this cluster."""
    p, r = cfg.parallel, cfg.rollout
    try:
        ranks = place_ranks(r, world)
        dp = validate_parallel(p, len(ranks.train_ranks), spec, has_cuda=True)
        vl.validate(spec, r.tp, r.expert_parallel)
        if r.expert_parallel and not spec.is_moe:
            raise ValueError("rollout.expert_parallel=true needs a mixture-of-experts model.")
    except (ConfigError, ValueError) as e:
        raise PlanError(str(e)) from None
    warnings: list[str] = []
    if gpus_per_node % r.tp and r.tp < world:
        raise PlanError(
            f"rollout.tp({r.tp}) does not divide --gpus-per-node({gpus_per_node}): a vLLM "
            f"engine would span two nodes; choose rollout.tp from "
            f"{[d for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0]}."
        )
    if r.tp > gpus_per_node:
        warnings.append(
            f"rollout.tp({r.tp}) > --gpus-per-node({gpus_per_node}): vLLM tensor parallelism "
            "across nodes is slow."
        )
    if p.tp > gpus_per_node:
        warnings.append(
            f"parallel.tp({p.tp}) > --gpus-per-node({gpus_per_node}): trainer tensor "
            "parallelism across nodes is slow; prefer pp or dp across nodes."
        )
    engines = len(ranks.engines)
    if cfg.grpo.batch.prompts_per_step % engines:
        raise PlanError(
            f"grpo.batch.prompts_per_step({cfg.grpo.batch.prompts_per_step}) is not a multiple of "
            "the "
            f"{engines} vLLM engines: make it a multiple of {engines}."
        )
    if ranks.placement == "disaggregated":
        if len(ranks.rollout_ranks) % gpus_per_node:
            warnings.append(
                f"{len(ranks.rollout_ranks)} rollout ranks are not whole nodes of "
                f"{gpus_per_node} GPUs: one node mixes trainer and vLLM ranks."
            )
    return ranks, dp, warnings


def _check_memory(
    mem: MemoryReport,
    capacity: int,
    gpu_memory_gb: float,
    cfg: Config,
    spec: ModelSpec,
    warnings: list[str],
    budget: TokenBudget,
) -> None:
    r = cfg.rollout
    one_seq = r.max_model_len * kv_bytes_per_token(spec, r.tp, DTYPE_BYTES[plan_dtype(cfg)])
    if mem.kv_cache_reserved < one_seq:
        weights = mem.peak.components["vllm_weights"]
        raise PlanError(
            f"vLLM cannot start: rollout.gpu_memory_utilization({r.gpu_memory_utilization}) x "
            f"{gpu_memory_gb:g} GiB leaves {_gib(mem.kv_cache_reserved)} for KV cache after "
            f"{_gib(weights)} of weights per rollout.tp({r.tp}) rank, less than one sequence of "
            f"rollout.max_model_len({r.max_model_len}) ({_gib(one_seq)}): raise "
            "rollout.gpu_memory_utilization or rollout.tp."
        )
    if mem.kv_cache_needed > mem.kv_cache_reserved:
        warnings.append(
            f"KV cache: {mem.sequences_per_engine} sequences x {r.max_model_len} tokens need "
            f"{_gib(mem.kv_cache_needed)} per engine rank but {_gib(mem.kv_cache_reserved)} is "
            "reserved: vLLM runs fewer sequences at once (slower rollouts)."
        )
    for m in mem.per_role.values():
        if m.total > capacity:
            top = sorted(m.components.items(), key=lambda kv: -kv[1])[:4]
            parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in top if v)
            fixes = [
                "raise parallel.tp, parallel.pp or parallel.cp"
                if cfg.grpo.batch.pack_sequences
                else "raise parallel.tp or parallel.pp"
            ]
            if not distributed_optimizer_on(cfg):
                fixes.append("set optim.distributed_optimizer=on")
            if "vllm_kv_cache" in m.components and m.components["vllm_kv_cache"]:
                fixes.append("lower rollout.gpu_memory_utilization")
            r = cfg.rollout
            if m.phases and not r.sleep_between_rollouts and m.peak_phase != "generate":
                fixes.append("set rollout.sleep_between_rollouts=true")
            if m.phases and r.trainer_offload != "all" and m.peak_phase == "generate":
                fixes.append("set rollout.trainer_offload=all")
            fixes.append(_activation_fix(budget, cfg))
            phase = f" in its {m.peak_phase} phase" if m.phases else ""
            raise PlanError(
                f"out of GPU memory: a {m.role} GPU needs {_gib(m.total)}{phase} (largest: "
                f"{parts} GiB) > --gpu-memory-gb {gpu_memory_gb:g}: " + ", ".join(fixes) + "."
            )


def _activation_fix(budget: TokenBudget, cfg: Config) -> str:
    """How to hold fewer activations, for the budget the plan used."""
    recompute = "" if cfg.model.recompute == "full" else "set model.recompute=full or "
    if budget.bound == "padded":
        return f"{recompute}lower grpo.batch.micro_batch_size"
    if budget.bound in ("config", "micro_batch_size"):
        return f"{recompute}set grpo.batch.micro_batch_tokens=auto (sized to fit)"
    return f"{recompute}shorten data.max_prompt_tokens + rollout.max_new_tokens"
