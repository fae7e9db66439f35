"""A Qwen3-30B-A3B weight sync on one 8xH100 node, from the static plan (issue 32), beside
NeMo-RL's published 0.5-1.5 s refit of the same model.

The trainer is TP=1 x EP=8 (DP=8: each rank holds 16 of the 128 experts of every layer and
the attention, routers and embeddings whole), colocated with vLLM engines of TP=T on the
same 8 GPUs; at T=8 also with vLLM's own expert parallelism (each vLLM rank holds 16 whole
experts: ``layouts.vllm.vllm_local_experts``). For each layout ``bridge.plan.build_plan``
gives the bytes per sync, split into in-process copies and cross-process sends, and the
busiest rank's share; the wire time is that rank's cross-process bytes at NVLink4 speed
plus its in-process bytes at HBM copy speed (the rule of ``projection.direct_wire_s``), a
lower bound: no vLLM reload, post-processing or cache reset. GPU-free, seconds. The text
report: ``projection/table.py format_moe_sync``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from megatron_grpo.bench.projection.model import GB, Assumptions
from megatron_grpo.bridge.plan import build_plan, plan_report
from megatron_grpo.distributed.placement import colocated_engines
from megatron_grpo.layouts.megatron import MegatronLayout
from megatron_grpo.models.shapes import preset_spec
from megatron_grpo.models.spec import megatron_padded_vocab


@dataclass(frozen=True)
class MoESyncAssumptions:
    """Every number the MoE sync projection uses that was not computed here."""

    model: str = "Qwen3-30B-A3B"
    """Shape from ``models.tiny.PRESETS`` (48 layers, hidden 2048, 128 experts of 768, top-8,
    32/4 heads of 128, vocabulary 151936, untied): 30.53 B parameters."""
    gpus: int = 8
    trainer_tp: int = 1
    trainer_ep: int = 8
    """Trainer EP=8 over DP=8 (ep divides dp): 16 experts per rank and layer."""
    rollouts: tuple[tuple[int, bool], ...] = ((1, False), (2, False), (4, False), (8, False),
                                              (8, True))  # fmt: skip
    """(vLLM TP, vLLM expert parallelism) of the colocated engines."""
    dtype_bytes: int = 2
    """bf16 weights on the wire."""
    nvlink_GBps: float = Assumptions.nvlink_GBps
    """H100 SXM NVLink4, per GPU per direction (as in the 7B projection)."""
    hbm_copy_GBps: float = Assumptions.hbm_copy_GBps
    """A device-to-device copy on H100 (as in the 7B projection)."""
    nemo_rl_sync_s: tuple[float, float] = (0.5, 1.5)
    """NeMo-RL's published refit time for Qwen3-30B-A3B (shard-to-shard NCCL), as issue 32
    cites it."""


def _layout_row(spec, trainer: MegatronLayout, a: MoESyncAssumptions, vtp: int, vep: bool):
    engines = colocated_engines(a.gpus, vtp)
    rep = plan_report(build_plan(spec, trainer, vtp, engines, a.dtype_bytes, rollout_ep=vep))
    in_proc: dict[int, int] = {}
    for (s, d), n in rep.bytes_per_link.items():
        if s == d:
            in_proc[s] = in_proc.get(s, 0) + n
    cross_links = [n for (s, d), n in rep.bytes_per_link.items() if s != d]
    busiest_cross = max([*rep.sent_per_rank.values(), *rep.received_per_rank.values(), 0])
    busiest_in = max(in_proc.values(), default=0)
    return {
        "rollout_tp": vtp, "rollout_ep": vep, "engines": len(engines),
        "bytes_per_sync": rep.bytes_per_sync, "in_process": rep.in_process_bytes,
        "cross_process": rep.cross_process_bytes, "busiest_link": max(cross_links, default=0),
        "busiest_rank_cross": busiest_cross, "busiest_rank_in_process": busiest_in,
        "wire_s": busiest_cross / (a.nvlink_GBps * GB) + busiest_in / (a.hbm_copy_GBps * GB),
    }  # fmt: skip


def moe_sync_projection(a: MoESyncAssumptions | None = None) -> dict[str, Any]:
    """Bytes and wire time of one sync for every rollout layout of ``a``."""
    a = a or MoESyncAssumptions()
    spec = preset_spec(a.model)
    if a.gpus % a.trainer_tp or (a.gpus // a.trainer_tp) % a.trainer_ep:
        raise ValueError(
            f"gpus({a.gpus}) / trainer_tp({a.trainer_tp}) must be a multiple of "
            f"trainer_ep({a.trainer_ep}): EP ranks are carved from the DP ranks."
        )
    trainer = MegatronLayout(
        a.trainer_tp, 1, dp=a.gpus // a.trainer_tp, ep=a.trainer_ep,
        padded_vocab=megatron_padded_vocab(spec.vocab_size, a.trainer_tp),
    )  # fmt: skip
    return {
        "assumptions": asdict(a),
        "parameters": spec.num_parameters,
        "model_bytes": spec.num_parameters * a.dtype_bytes,
        "rows": [_layout_row(spec, trainer, a, vtp, vep) for vtp, vep in a.rollouts],
    }
