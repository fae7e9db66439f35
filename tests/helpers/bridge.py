"""The bridge's references, written apart from the code they check: a single-process
executor of a sync plan (``apply_plan_locally``; ``execute`` also counts each write), the
shards every trainer rank holds (``trainer_state``), what each vLLM rank holds for an HF
checkpoint derived from vLLM's weight_loader semantics (``vllm_shards_from_hf``), the
engines of a placement (``placed_engines``) and the check that a plan delivers every vLLM
shard (``check_delivers``), and the engine settings of the end-to-end syncs (``ENGINE_KW``)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from pathlib import Path

import torch

from megatron_grpo.bridge.plan import SyncPlan, rank_lookup, src_name
from megatron_grpo.bridge.transport import wire_dtype
from megatron_grpo.layouts import megatron as mg
from megatron_grpo.layouts.pieces import assemble, reader_from_dict
from tests.helpers.layouts import arange_hf

F64 = torch.float64


def apply_plan_locally(
    plan: SyncPlan,
    sources: Mapping[int, Mapping[str, torch.Tensor]],
    dtype: torch.dtype | None = None,
) -> dict[tuple[int, str], torch.Tensor]:
    """Every destination shard built in one process, copy by copy.

    ``sources[rank][src_name]`` are the trainer shards; returns ``{(rank, name): tensor}``,
    zero where no copy writes (vocabulary padding).
    """
    dtype = dtype or wire_dtype(plan.element_size)
    out = {(d.rank, d.name): torch.zeros(d.shape, dtype=dtype) for d in plan.dst_tensors}
    for c in plan.copies:
        src = sources[c.src_rank][c.src_name].narrow(c.dim, c.src_start, c.length)
        out[(c.dst_rank, c.dst_name)].narrow(c.dim, c.dst_start, c.length).copy_(src)
    return out


def trainer_state(
    spec, trainer: mg.MegatronLayout, rank_of=None
) -> dict[tuple[int, str], torch.Tensor]:
    """(global rank, src_name) -> shard, as every trainer rank would hold it."""
    read = reader_from_dict(arange_hf(spec))
    global_rank = rank_lookup(trainer, rank_of)
    out = {}
    for dp, pp, vp, tp in itertools.product(
        range(trainer.dp), range(trainer.pp), range(trainer.vpp), range(trainer.tp)
    ):
        for lay in mg.chunk_shards(spec, trainer, pp, vp, tp):
            out[(global_rank(dp, pp, tp), src_name(trainer, vp, lay.name))] = assemble(
                lay, read, F64
            )
    return out


def execute(plan, state) -> dict[tuple[int, str], torch.Tensor]:
    """Reference executor: zero destinations, then every copy."""
    dst = {(d.rank, d.name): torch.zeros(d.shape, dtype=F64) for d in plan.dst_tensors}
    written = {k: torch.zeros(v.shape, dtype=torch.int32) for k, v in dst.items()}
    for c in plan.copies:
        src = state[(c.src_rank, c.src_name)].narrow(c.dim, c.src_start, c.length)
        dst[(c.dst_rank, c.dst_name)].narrow(c.dim, c.dst_start, c.length).copy_(src)
        written[(c.dst_rank, c.dst_name)].narrow(c.dim, c.dst_start, c.length).add_(1)
    for k, w in written.items():
        assert int(w.max()) <= 1, f"{k} written twice"
    return dst


def placed_engines(placement: str, world: int, vtp: int) -> list[list[int]]:
    """The engines' global ranks: ``colocated``, ``world / vtp`` engines tiling the trainer
    ranks; ``separate``, two engines on ranks after the trainer's."""
    if placement == "colocated":
        return [list(range(e * vtp, (e + 1) * vtp)) for e in range(world // vtp)]
    return [list(range(world + e * vtp, world + (e + 1) * vtp)) for e in range(2)]


def check_delivers(plan, state, spec, engines: list[list[int]], vtp: int) -> int:
    """Execute ``plan`` over the trainer ``state`` and check that every vLLM rank of every
    engine gets its shards of the arange HF weights exactly; return the bytes they need
    (fp32, padding rows excluded), what a minimal plan sends."""
    from megatron_grpo.layouts import vllm as vl

    got = execute(plan, state)
    read = reader_from_dict(arange_hf(spec))
    needed = 0
    for ranks in engines:
        for r, rank in enumerate(ranks):
            for lay in vl.rank_shards(spec, vtp, r):
                ref = assemble(lay, read, F64)
                assert torch.equal(got[(rank, lay.name)], ref), (rank, lay.name)
                row = lay.numel // lay.shape[lay.dim]
                needed += (lay.shape[lay.dim] - lay.zero_length) * row * 4
    return needed


def _load_hf(model_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return cfg, sd


def vllm_shards_from_hf(model_dir: str | Path, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """The tensors vLLM rank ``rank`` of a TP=``tp`` engine holds for an HF checkpoint."""
    cfg, sd = _load_hf(Path(model_dir))
    nq = cfg["num_attention_heads"]
    ng = cfg.get("num_key_value_heads", nq)
    vocab = cfg["vocab_size"]

    def rows(t: torch.Tensor, n_blocks: int, i: int) -> torch.Tensor:
        size = t.shape[0] // n_blocks
        return t[i * size : (i + 1) * size]

    def cols(t: torch.Tensor) -> torch.Tensor:
        size = t.shape[1] // tp
        return t[:, rank * size : (rank + 1) * size]

    def kv(t: torch.Tensor) -> torch.Tensor:
        if tp <= ng:
            return rows(t, tp, rank)
        return rows(t, ng, rank // (tp // ng))

    def vocab_rows(t: torch.Tensor) -> torch.Tensor:
        padded = -(-vocab // 64) * 64
        full = torch.zeros(padded, t.shape[1], dtype=t.dtype)
        full[:vocab] = t
        return rows(full, tp, rank)

    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": vocab_rows(sd["model.embed_tokens.weight"])
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            if f"{p}self_attn.q_proj.{kind}" in sd:
                out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat(
                    [
                        rows(sd[f"{p}self_attn.q_proj.{kind}"], tp, rank),
                        kv(sd[f"{p}self_attn.k_proj.{kind}"]),
                        kv(sd[f"{p}self_attn.v_proj.{kind}"]),
                    ]
                )
        out[f"{p}self_attn.o_proj.weight"] = cols(sd[f"{p}self_attn.o_proj.weight"])
        out[f"{p}mlp.gate_up_proj.weight"] = torch.cat(
            [
                rows(sd[f"{p}mlp.gate_proj.weight"], tp, rank),
                rows(sd[f"{p}mlp.up_proj.weight"], tp, rank),
            ]
        )
        out[f"{p}mlp.down_proj.weight"] = cols(sd[f"{p}mlp.down_proj.weight"])
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "self_attn.q_norm",
            "self_attn.k_norm",
        ):
            if f"{p}{norm}.weight" in sd:
                out[f"{p}{norm}.weight"] = sd[f"{p}{norm}.weight"]
    out["model.norm.weight"] = sd["model.norm.weight"]
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = vocab_rows(sd["lm_head.weight"])
    return {k: v.contiguous() for k, v in out.items()}


ENGINE_KW = dict(max_model_len=64, cpu_kv_cache_gb=0.05, enforce_eager=True)


def model_pair(root: Path, name: str, **shape) -> tuple[Path, Path]:
    """Checkpoints A (seed 1) and B (seed 2) of one tiny shape under ``root``, built once.
    Odd vocabulary (extra_vocab=7): Megatron (multiple of 128*tp) and vLLM (64) pad
    differently."""
    from megatron_grpo.models.tiny import build_hf_model

    a, b = root / f"{name}_a", root / f"{name}_b"
    if not (b / "config.json").exists():
        build_hf_model(a, seed=1, extra_vocab=7, **shape)
        build_hf_model(b, seed=2, extra_vocab=7, **shape)
    return a, b


def sync_b_over_a(eng, a: Path, b: Path, spec, parallel, rollout_tp: int) -> dict:
    """In a rank of a spawned gloo world: a Megatron policy at ``parallel`` (a
    ParallelConfig) holding checkpoint B, the engine reset to checkpoint A, one bridge sync.
    Returns the engine's shards ``before`` and after (``got``) the sync, the bytes sent
    (``bytes``, ``links``) and the plan's (``minimal``, ``plan_links``)."""
    from functools import partial

    from megatron_grpo.bridge.transfer_group import PlanInputs
    from megatron_grpo.bridge.weight_sync import colocated_sender
    from megatron_grpo.config.schema import ModelConfig, SyncConfig
    from megatron_grpo.distributed import init_distributed
    from megatron_grpo.distributed.placement import colocated_engines
    from megatron_grpo.layouts.io import load_hf_into_megatron
    from megatron_grpo.policy.policy import build_policy

    ctx = init_distributed(parallel, spec)
    policy = build_policy(
        spec, ctx, ModelConfig(hf_path=str(b), dtype="float32", transformer_impl="local"),
        None, init_weights=partial(load_hf_into_megatron, hf_dir=b, spec=spec, ctx=ctx),
    )  # fmt: skip
    sync = SyncConfig(bucket_mb=0.05, timeout_s=60)
    engines = colocated_engines(ctx.world_size, rollout_tp)
    inputs = PlanInputs.of(b, ctx, policy, sync, rollout_tp, engines)
    ws = colocated_sender(inputs, spec, ctx, eng, sync)
    eng.reload_from_hf(a)  # the engine must really receive B from the bridge
    before = eng.export_shards()[0]
    report = ws.push(policy)
    return {
        "before": before,
        "got": eng.export_shards()[0],
        "bytes": report.bytes,
        "minimal": ws.plan.minimal_bytes,
        "links": report.bytes_per_link,
        "plan_links": {f"{s}->{d}": n for (s, d), n in ws.plan.bytes_per_link().items()},
    }
