"""vLLM (Llama/Qwen2/Qwen3, Qwen3-MoE/Qwen2-MoE) parameter names and per-TP-rank shards,
as HF slices, verified against vLLM 0.32's loaders. Each layout, its shapes and the vLLM
source lines it follows: docs/layouts.md, "vLLM (0.32)".
"""

from __future__ import annotations

import dataclasses
import re

from megatron_grpo.layouts import hf
from megatron_grpo.layouts.megatron import UnknownParameterError
from megatron_grpo.layouts.pieces import Piece, ShardLayout, vocab_rows
from megatron_grpo.models.spec import ModelSpec, vllm_padded_vocab

LM_HEAD = "lm_head.weight"


def validate(spec: ModelSpec, tp: int, expert_parallel: bool = False) -> None:
    """Raise ValueError when vLLM cannot split ``spec`` over ``tp`` ranks (with
    ``expert_parallel`` the experts are whole on each rank, so their width need not split)."""
    np_, ng = spec.num_heads, spec.num_kv_heads
    if tp < 1 or np_ % tp:
        raise ValueError(
            f"num_heads={np_} is not divisible by rollout tp={tp} (QKVParallelLinear)."
        )
    if ng % tp and tp % ng:
        raise ValueError(
            f"num_kv_heads={ng} must be a multiple or a divisor of rollout tp={tp} "
            "(vLLM attention asserts it)."
        )
    if spec.ffn_hidden_size % tp:
        raise ValueError(f"ffn_hidden_size={spec.ffn_hidden_size} not divisible by rollout tp={tp}")
    if vllm_padded_vocab(spec.vocab_size, tp) % tp:
        raise ValueError(
            f"vLLM pads vocab {spec.vocab_size} to {vllm_padded_vocab(spec.vocab_size, tp)}, "
            f"not divisible by rollout tp={tp}."
        )
    if expert_parallel and spec.is_moe and spec.num_experts < tp:
        raise ValueError(
            f"num_experts={spec.num_experts} < rollout tp={tp}: with vLLM's expert parallelism "
            "some rank would hold no expert."
        )
    if spec.is_moe and not expert_parallel and spec.moe_ffn_hidden_size % tp:
        raise ValueError(
            f"moe_intermediate_size={spec.moe_ffn_hidden_size} not divisible by rollout tp={tp}"
        )
    if spec.shared_expert_ffn_hidden_size % tp:
        raise ValueError(
            f"shared_expert_intermediate_size={spec.shared_expert_ffn_hidden_size} not "
            f"divisible by rollout tp={tp}"
        )
    if spec.family == "qwen2" and spec.head_dim * spec.num_heads != spec.hidden_size:
        # vllm/model_executor/models/qwen2.py: head_dim = hidden_size // total_num_heads.
        raise ValueError(
            f"vLLM's Qwen2 ignores head_dim={spec.head_dim} and uses hidden_size/num_heads="
            f"{spec.hidden_size // spec.num_heads}: such a Qwen2 cannot be served."
        )


# vLLM loads HF's q/k/v projections into one ``qkv_proj`` and gate/up into one
# ``gate_up_proj`` (``packed_modules_mapping`` and ``hf_to_vllm_mapper``'s
# ``orig_to_new_stacked`` in vllm/model_executor/models/llama.py, qwen2.py, qwen3.py); every
# other HF tensor is a vLLM parameter of the same name.
_STACKED = (
    (re.compile(r"\.[qkv]_proj\."), ".qkv_proj."),
    (re.compile(r"\.(gate|up)_proj\."), ".gate_up_proj."),
)


EXPERTS = "mlp.experts.routed_experts."
"""Prefix (after the layer's) of vLLM's fused expert parameters ``w13_weight``, ``w2_weight``."""
_HF_EXPERT_RE = re.compile(
    r"^(model\.layers\.\d+\.)mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$"
)
_SLOT_RE = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts\.routed_experts\.w(?:13|2)_weight)\.(\d+)$"
)


def expert_slot(name: str) -> tuple[str, int] | None:
    """``(fused vLLM parameter, expert)`` of an expert slot name
    (``model.layers.3.mlp.experts.routed_experts.w13_weight.5`` -> (``...w13_weight``, 5)),
    None for every other name."""
    m = _SLOT_RE.match(name)
    return (m.group(1), int(m.group(2))) if m else None


def _bridge_name(name: str) -> str:
    """The bridge's name of the vLLM tensor an HF tensor goes into (an expert slot for
    per-expert HF tensors)."""
    m = _HF_EXPERT_RE.match(name)
    if m:
        fused = "w2_weight" if m.group(3) == "down" else "w13_weight"
        return f"{m.group(1)}{EXPERTS}{fused}.{m.group(2)}"
    for hf_part, fused in _STACKED:
        name = hf_part.sub(fused, name)
    return name


def param_names(spec: ModelSpec) -> list[str]:
    """vLLM parameter names (global layer index, PP=1 on the rollout side), in HF order;
    MoE experts as expert slots (``expert_slot``)."""
    return list(dict.fromkeys(_bridge_name(name) for name in hf.hf_shapes(spec)))


def _qkv_rank(spec: ModelSpec, tp: int, r: int, pre: str, kind: str) -> tuple[Piece, ...]:
    hn = spec.head_dim
    q_heads = spec.num_heads // tp
    kv_heads = max(1, spec.num_kv_heads // tp)
    replicas = max(1, tp // spec.num_kv_heads)
    kv_shard = r // replicas
    return (
        Piece(f"{pre}self_attn.q_proj.{kind}", r * q_heads * hn, q_heads * hn),
        Piece(f"{pre}self_attn.k_proj.{kind}", kv_shard * kv_heads * hn, kv_heads * hn),
        Piece(f"{pre}self_attn.v_proj.{kind}", kv_shard * kv_heads * hn, kv_heads * hn),
    )


def shard(spec: ModelSpec, tp: int, tp_rank: int, name: str) -> ShardLayout:
    """vLLM TP rank ``tp_rank``'s shard of ``name``, as HF pieces.

    Shapes (T = tp, kvr = max(1, ng/T)): qkv_proj ``((np/T+2*kvr)*hn, h)``, gate_up
    ``(2F/T, h)``, o_proj ``(h, np*hn/T)``, down ``(h, F/T)``, embed/lm_head ``(Vv/T, h)``.
    """
    h, hn, f, r = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size, tp_rank
    vv = vllm_padded_vocab(spec.vocab_size, tp)
    if name == hf.EMBED:
        return ShardLayout(name, (vv // tp, h), 0, vocab_rows(hf.EMBED, spec.vocab_size, vv, tp, r))
    if name == LM_HEAD and not spec.tie_word_embeddings:
        return ShardLayout(
            name, (vv // tp, h), 0, vocab_rows(hf.LM_HEAD, spec.vocab_size, vv, tp, r)
        )
    if name == hf.FINAL_NORM:
        return ShardLayout(name, (h,), 0, (Piece(name, 0, h),))
    layer = hf.hf_layer_of(name)
    if layer is not None and layer < spec.num_layers:
        pre = hf.layer_prefix(layer)
        suffix = name[len(pre) :]
        if suffix in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            return ShardLayout(name, (h,), 0, (Piece(name, 0, h),))
        if spec.qk_norm and suffix in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            return ShardLayout(name, (hn,), 0, (Piece(name, 0, hn),))
        if suffix == "self_attn.qkv_proj.weight" or (
            spec.qkv_bias and suffix == "self_attn.qkv_proj.bias"
        ):
            kind = suffix.rsplit(".", 1)[1]
            pieces = _qkv_rank(spec, tp, r, pre, kind)
            rows = sum(p.length for p in pieces)
            return ShardLayout(name, (rows, h) if kind == "weight" else (rows,), 0, pieces)
        if suffix == "self_attn.o_proj.weight":
            cols = spec.num_heads * hn // tp
            return ShardLayout(name, (h, cols), 1, (Piece(name, r * cols, cols),))
        if suffix == "mlp.gate_up_proj.weight":
            rows = f // tp
            pieces = (
                Piece(pre + "mlp.gate_proj.weight", r * rows, rows),
                Piece(pre + "mlp.up_proj.weight", r * rows, rows),
            )
            return ShardLayout(name, (2 * rows, h), 0, pieces)
        if suffix == "mlp.down_proj.weight":
            cols = f // tp
            return ShardLayout(name, (h, cols), 1, (Piece(name, r * cols, cols),))
        if spec.is_moe:
            found = _moe_shard(spec, tp, r, name, pre, suffix)
            if found is not None:
                return found
    raise UnknownParameterError(
        f"unknown vLLM parameter {name!r} for a {spec.family} model with {spec.num_layers} "
        f"layers (tied={spec.tie_word_embeddings}, qkv_bias={spec.qkv_bias}, "
        f"qk_norm={spec.qk_norm})."
    )


def _moe_shard(
    spec: ModelSpec, tp: int, r: int, name: str, pre: str, suffix: str
) -> ShardLayout | None:
    """The router, Qwen2-MoE's shared expert and its gate, or one expert slot of an MoE
    layer; None for other names."""
    h, e_count = spec.hidden_size, spec.num_experts
    if suffix == "mlp.gate.weight":
        return ShardLayout(name, (e_count, h), 0, (Piece(name, 0, e_count),))
    if spec.shared_expert_ffn_hidden_size:  # models/qwen2_moe.py: a Qwen2MoeMLP and a gate
        cols = spec.shared_expert_ffn_hidden_size // tp
        hf_mlp = pre + "mlp.shared_expert."
        if suffix == "mlp.shared_expert_gate.weight":
            return ShardLayout(name, (1, h), 0, (Piece(name, 0, 1),))
        if suffix == "mlp.shared_expert.gate_up_proj.weight":
            pieces = (
                Piece(hf_mlp + "gate_proj.weight", r * cols, cols),
                Piece(hf_mlp + "up_proj.weight", r * cols, cols),
            )
            return ShardLayout(name, (2 * cols, h), 0, pieces)
        if suffix == "mlp.shared_expert.down_proj.weight":
            return ShardLayout(name, (h, cols), 1, (Piece(name, r * cols, cols),))
    slot = expert_slot(name)
    if slot is None or slot[1] >= e_count:
        return None
    fused, e = slot
    cols = spec.moe_ffn_hidden_size // tp
    hf_mlp = f"{pre}mlp.experts.{e}."
    if fused.endswith("w13_weight"):
        pieces = (
            Piece(hf_mlp + "gate_proj.weight", r * cols, cols),
            Piece(hf_mlp + "up_proj.weight", r * cols, cols),
        )
        return ShardLayout(name, (2 * cols, h), 0, pieces)
    return ShardLayout(name, (h, cols), 1, (Piece(hf_mlp + "down_proj.weight", r * cols, cols),))


def vllm_local_experts(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The global experts vLLM's EP rank ``ep_rank`` of ``ep_size`` holds, in local-row
    order: vLLM's ``linear`` placement (``determine_expert_map``): E // ep each, the first
    E % ep ranks one more, contiguous."""
    base, extra = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, extra)
    return range(start, start + base + (ep_rank < extra))


def rank_shards(
    spec: ModelSpec, tp: int, tp_rank: int, expert_parallel: bool = False
) -> list[ShardLayout]:
    """Every parameter shard of one vLLM TP rank; with ``expert_parallel`` (vLLM's
    ``enable_expert_parallel``) its experts are whole, only its own, slot j = local row j."""
    if not expert_parallel or not spec.is_moe:
        return [shard(spec, tp, tp_rank, n) for n in param_names(spec)]
    local = vllm_local_experts(spec.num_experts, tp, tp_rank)
    out = []
    for name in param_names(spec):
        slot = expert_slot(name)
        if slot is None:
            out.append(shard(spec, tp, tp_rank, name))
        elif slot[1] < len(local):  # local row j holds global expert local[j], whole
            whole = shard(spec, 1, 0, f"{slot[0]}.{local[slot[1]]}")
            out.append(dataclasses.replace(whole, name=name))
    return out
