"""Megatron-core GPTModel parameter names and per-TP-rank shards (dense and MoE, local and TE
specs, any PP/VPP chunk), as HF slices, verified against megatron-core's layers. Each
layout, its shapes and the megatron source it follows: docs/layouts.md, "Megatron".
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import KW_ONLY, dataclass
from typing import Any, Literal

from megatron_grpo.layouts import hf
from megatron_grpo.layouts.pieces import Piece, ShardLayout, cut, merge, vocab_rows
from megatron_grpo.models.spec import ModelSpec, megatron_padded_vocab

NormStyle = Literal["local", "te"]

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"

# Norm names per spec style: (attention input norm, MLP input norm).
NORM_NAMES: dict[str, tuple[str, str]] = {
    "local": ("input_layernorm.weight", "pre_mlp_layernorm.weight"),
    "te": ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"),
}

ROUTER = "mlp.router.weight"
EXPERTS = "mlp.experts.local_experts."
SHARED = "mlp.shared_experts."

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
SHARED_NAMES = ("linear_fc1.weight", "linear_fc2.weight", "gate_weight")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")


class UnknownParameterError(KeyError):
    """A Megatron or vLLM parameter name the layouts do not know."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


@dataclass(frozen=True)
class MegatronLayout:
    """How the trainer's GPTModel is split over its ranks: the one description of the
    trainer's layout (the layouts, the checkpoint I/O, the bridge's plan and the plan sent to
    disaggregated engines all take it). Built from a running trainer by :meth:`of`."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    """Data-parallel replicas: every one holds the same shards (more sources for the bridge).
    Context-parallel ranks hold the same shards too (they split tokens, not weights), so
    ``of`` counts dp x cp replicas: megatron's rank order ``tp-cp-ep-dp-pp`` with cp and dp
    merged into one replica index (``dp_rank * cp + cp_rank``) is this layout's
    ``tp-dp-pp``, and the sync plan is the one of dp x cp data-parallel replicas."""
    _: KW_ONLY
    padded_vocab: int | None = None
    """Rows of the embedding/output layer over all TP ranks; None means Megatron's rule
    ``megatron_padded_vocab(V, tp)`` (make_vocab_size_divisible_by=128)."""
    norm_style: NormStyle = "local"
    """``local`` or ``te`` parameter names for the layer norms (``NORM_NAMES``)."""
    ep: int = 1
    """Expert-parallel ranks (MoE): each holds ``num_experts / ep`` experts of every layer;
    they are a sub-axis of the ``dp`` replicas, which hold the same non-expert shards."""

    @classmethod
    def of(
        cls, ctx: Any, param_names: Iterable[str] = (), padded_vocab: int | None = None
    ) -> MegatronLayout:
        """The layout of a running trainer: sizes from ``ctx`` (the
        ``distributed.ParallelContext``, or anything with its ``tp``/``pp``/``vpp``/``dp``,
        and ``cp``: replicas like dp), norm naming from this rank's parameter names."""
        replicas = getattr(ctx, "dp", 1) * getattr(ctx, "cp", 1)
        return cls(
            ctx.tp, ctx.pp, getattr(ctx, "vpp", None) or 1, replicas,
            padded_vocab=padded_vocab, norm_style=detect_norm_style(list(param_names)),
            ep=getattr(ctx, "ep", 1),
        )  # fmt: skip

    def vocab(self, spec: ModelSpec) -> int:
        return self.padded_vocab or megatron_padded_vocab(spec.vocab_size, self.tp)


def strip_wrappers(name: str) -> str:
    """Drop DDP / Float16Module prefixes (``module.``) from a parameter name."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def validate(spec: ModelSpec, ml: MegatronLayout) -> None:
    """Raise ValueError when megatron-core cannot split ``spec`` as ``ml`` says."""
    t, ng, np_ = ml.tp, spec.num_kv_heads, spec.num_heads
    if t < 1 or ml.pp < 1 or ml.vpp < 1:
        raise ValueError(f"tp={t}, pp={ml.pp}, vpp={ml.vpp} must all be >= 1")
    if np_ % t:
        raise ValueError(f"num_heads={np_} is not divisible by trainer tp={t}: choose tp | {np_}.")
    if ng % t and t % ng:
        # megatron/core/transformer/transformer_config.py __post_init__
        raise ValueError(
            f"num_kv_heads={ng} must be a multiple or a divisor of trainer tp={t} "
            "(megatron-core TransformerConfig check)."
        )
    if (np_ + 2 * ng) * spec.head_dim % t:
        raise ValueError(f"fused QKV rows {(np_ + 2 * ng) * spec.head_dim} not divisible by tp={t}")
    if spec.ffn_hidden_size % t:
        raise ValueError(f"ffn_hidden_size={spec.ffn_hidden_size} not divisible by tp={t}")
    if spec.num_layers % (ml.pp * ml.vpp):
        raise ValueError(
            f"num_layers={spec.num_layers} is not divisible by pp*vpp={ml.pp * ml.vpp}: "
            "uneven pipeline splits are not supported by the layouts."
        )
    if ml.vpp > 1 and ml.pp == 1:
        raise ValueError("vpp > 1 needs pp > 1 (megatron-core interleaved schedule)")
    vm = ml.vocab(spec)
    if vm < spec.vocab_size or vm % t:
        raise ValueError(
            f"padded vocab {vm} must be >= vocab {spec.vocab_size} and divisible by tp={t}"
        )
    if ml.ep < 1 or spec.num_experts % ml.ep or (ml.ep > 1 and not spec.is_moe):
        raise ValueError(
            f"ep={ml.ep} must be 1 for a dense model and divide the {spec.num_experts} experts "
            "of an MoE one."
        )
    for width in (spec.moe_ffn_hidden_size, spec.shared_expert_ffn_hidden_size):
        if width % t:
            raise ValueError(f"expert FFN width {width} not divisible by tp={t}")
    if ml.norm_style not in NORM_NAMES:
        raise ValueError(f"norm_style={ml.norm_style!r}: expected one of {sorted(NORM_NAMES)}")


def layers_per_chunk(spec: ModelSpec, ml: MegatronLayout) -> int:
    return spec.num_layers // (ml.pp * ml.vpp)


def layer_offset(spec: ModelSpec, ml: MegatronLayout, pp_rank: int, vp_stage: int = 0) -> int:
    """Global index of local layer 0 on chunk (pp_rank, vp_stage); get_transformer_layer_offset,
    even split, no embedding/loss accounting."""
    if ml.pp == 1:
        return 0
    return vp_stage * (spec.num_layers // ml.vpp) + pp_rank * layers_per_chunk(spec, ml)


def is_first_chunk(ml: MegatronLayout, pp_rank: int, vp_stage: int) -> bool:
    return pp_rank == 0 and vp_stage == 0


def is_last_chunk(ml: MegatronLayout, pp_rank: int, vp_stage: int) -> bool:
    return pp_rank == ml.pp - 1 and vp_stage == ml.vpp - 1


def detect_norm_style(names: Iterable[str]) -> NormStyle:
    """``te`` if the model carries TE-folded norm names, else ``local``."""
    if any(n.endswith("linear_qkv.layer_norm_weight") for n in names):
        return "te"
    return "local"


def chunk_names(spec: ModelSpec, ml: MegatronLayout, pp_rank: int, vp_stage: int = 0) -> list[str]:
    """Parameter names (local layer index) of one model chunk, identical on every TP rank."""
    out: list[str] = []
    if is_first_chunk(ml, pp_rank, vp_stage):
        out.append(EMBEDDING)
    attn_norm, mlp_norm = NORM_NAMES[ml.norm_style]
    for j in range(layers_per_chunk(spec, ml)):
        p = f"decoder.layers.{j}."
        out.append(p + attn_norm)
        out.append(p + "self_attention.linear_qkv.weight")
        if spec.qkv_bias:
            out.append(p + "self_attention.linear_qkv.bias")
        if spec.qk_norm:
            out.append(p + "self_attention.q_layernorm.weight")
            out.append(p + "self_attention.k_layernorm.weight")
        out.append(p + "self_attention.linear_proj.weight")
        out.append(p + mlp_norm)
        if spec.is_moe:
            out.append(p + ROUTER)
            for e in range(spec.num_experts // ml.ep):
                out.append(f"{p}{EXPERTS}{e}.linear_fc1.weight")
                out.append(f"{p}{EXPERTS}{e}.linear_fc2.weight")
            if spec.shared_expert_ffn_hidden_size:
                out += [f"{p}{SHARED}{n}" for n in SHARED_NAMES]
        else:
            out.append(p + "mlp.linear_fc1.weight")
            out.append(p + "mlp.linear_fc2.weight")
    if is_last_chunk(ml, pp_rank, vp_stage):
        out.append(FINAL_NORM)
        if not (spec.tie_word_embeddings and is_first_chunk(ml, pp_rank, vp_stage)):
            out.append(OUTPUT)
    return out


def _qkv_interleaved(spec: ModelSpec, kind: str) -> tuple[Piece, ...]:
    """The full fused QKV rows (weight or bias) as HF pieces, per group [q..; k; v]."""
    hn, hpg, p = spec.head_dim, spec.heads_per_group, "self_attn."
    pieces: list[Piece] = []
    for g in range(spec.num_kv_heads):
        pieces.append(Piece(f"{p}q_proj.{kind}", g * hpg * hn, hpg * hn))
        pieces.append(Piece(f"{p}k_proj.{kind}", g * hn, hn))
        pieces.append(Piece(f"{p}v_proj.{kind}", g * hn, hn))
    return tuple(pieces)


def _prefixed(pieces: tuple[Piece, ...], prefix: str) -> tuple[Piece, ...]:
    return tuple(Piece(prefix + p.src if p.src else None, p.start, p.length) for p in pieces)


def _mlp_shard(name: str, hf_mlp: str, suffix: str, f: int, h: int, t: int, r: int) -> ShardLayout:
    """A dense MLP's ``linear_fc1`` (gate and up rows) or ``linear_fc2`` (down columns) of
    width ``f`` on TP rank ``r`` of ``t``; ``hf_mlp`` the HF prefix of its projections."""
    if suffix == "linear_fc1.weight":
        rows = f // t
        pieces = merge(
            [
                Piece(hf_mlp + "gate_proj.weight", r * rows, rows),
                Piece(hf_mlp + "up_proj.weight", r * rows, rows),
            ]
        )
        return ShardLayout(name, (2 * rows, h), 0, pieces)
    cols = f // t
    return ShardLayout(name, (h, cols), 1, (Piece(hf_mlp + "down_proj.weight", r * cols, cols),))


def _expert_shard(
    spec: ModelSpec, name: str, pre: str, suffix: str, ep: int, ep_rank: int, t: int, r: int
) -> ShardLayout | None:
    """The MoE router, the shared expert (Qwen2-MoE), or local expert j of EP rank
    ``ep_rank`` (global expert ``ep_rank*E/ep + j``), or None if ``suffix`` is none of them."""
    h = spec.hidden_size
    if suffix == ROUTER:
        e = spec.num_experts
        return ShardLayout(name, (e, h), 0, (Piece(pre + "mlp.gate.weight", 0, e),))
    if spec.shared_expert_ffn_hidden_size and suffix.startswith(SHARED):
        part = suffix[len(SHARED) :]
        if part == "gate_weight":
            return ShardLayout(
                name, (1, h), 0, (Piece(pre + "mlp.shared_expert_gate.weight", 0, 1),)
            )
        if part in SHARED_NAMES:
            f = spec.shared_expert_ffn_hidden_size
            return _mlp_shard(name, pre + "mlp.shared_expert.", part, f, h, t, r)
        return None
    m = _EXPERT_RE.match(suffix)
    per_rank = spec.num_experts // ep
    if m is None or int(m.group(1)) >= per_rank:
        return None
    expert = ep_rank * per_rank + int(m.group(1))
    hf_mlp = f"{pre}mlp.experts.{expert}."
    return _mlp_shard(name, hf_mlp, m.group(2), spec.moe_ffn_hidden_size, h, t, r)


def _layer_shard(
    spec: ModelSpec, name: str, pre: str, suffix: str, t: int, r: int
) -> ShardLayout | None:
    """The shard of transformer-layer parameter ``name`` (``suffix`` after the layer index;
    ``pre`` the HF layer prefix) on TP rank ``r`` of ``t``, or None if it is not one (nor a
    dense MLP's: MoE layers are ``_expert_shard``'s)."""
    h, hn, f = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    if suffix in (NORM_NAMES["local"][0], NORM_NAMES["te"][0]):
        return ShardLayout(name, (h,), 0, (Piece(pre + "input_layernorm.weight", 0, h),))
    if suffix in (NORM_NAMES["local"][1], NORM_NAMES["te"][1]):
        return ShardLayout(name, (h,), 0, (Piece(pre + "post_attention_layernorm.weight", 0, h),))
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        if kind == "bias" and not spec.qkv_bias:
            raise UnknownParameterError(f"{name}: {spec.family} has no QKV bias")
        full = _qkv_interleaved(spec, kind)
        rows = (spec.num_heads + 2 * spec.num_kv_heads) * hn // t
        pieces = _prefixed(cut(full, r * rows, rows), pre)
        shape = (rows, h) if kind == "weight" else (rows,)
        return ShardLayout(name, shape, 0, pieces)
    if spec.qk_norm and suffix in (
        "self_attention.q_layernorm.weight",
        "self_attention.k_layernorm.weight",
    ):
        which = "q_norm" if ".q_" in suffix else "k_norm"
        return ShardLayout(name, (hn,), 0, (Piece(f"{pre}self_attn.{which}.weight", 0, hn),))
    if suffix == "self_attention.linear_proj.weight":
        cols = spec.num_heads * hn // t
        return ShardLayout(
            name, (h, cols), 1, (Piece(pre + "self_attn.o_proj.weight", r * cols, cols),)
        )
    if suffix in ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight") and not spec.is_moe:
        return _mlp_shard(name, pre + "mlp.", suffix[len("mlp.") :], f, h, t, r)
    return None


def shard(
    spec: ModelSpec,
    ml: MegatronLayout,
    name: str,
    pp_rank: int = 0,
    vp_stage: int = 0,
    tp_rank: int = 0,
    ep_rank: int = 0,
) -> ShardLayout:
    """The shard of Megatron parameter ``name`` (local layer index; ``module.`` prefixes
    allowed) held by (pp_rank, vp_stage, tp_rank, ep_rank), as HF pieces.

    Shapes per TP rank (T = ml.tp): QKV ``((np+2ng)*hn/T, h)``, bias ``((np+2ng)*hn/T,)``,
    linear_proj ``(h, np*hn/T)``, fc1 ``(2F/T, h)``, fc2 ``(h, F/T)``, embedding/output
    ``(Vm/T, h)``, norms ``(h,)``, q/k_layernorm ``(hn,)``; MoE: router ``(E, h)``, each
    local expert's fc1 ``(2Fm/T, h)`` and fc2 ``(h, Fm/T)``.
    Raises :class:`UnknownParameterError` naming the name when it is not a parameter of
    this model on this chunk.
    """
    t, r, h = ml.tp, tp_rank, spec.hidden_size
    local = strip_wrappers(name)
    first, last = is_first_chunk(ml, pp_rank, vp_stage), is_last_chunk(ml, pp_rank, vp_stage)
    vm = ml.vocab(spec)

    if local == EMBEDDING and first:
        pieces = vocab_rows(hf.EMBED, spec.vocab_size, vm, t, r)
        return ShardLayout(name, (vm // t, h), 0, pieces)
    if local == OUTPUT and last and not (spec.tie_word_embeddings and first):
        pieces = vocab_rows(hf.output_source(spec), spec.vocab_size, vm, t, r)
        return ShardLayout(name, (vm // t, h), 0, pieces)
    if local == FINAL_NORM and last:
        return ShardLayout(name, (h,), 0, (Piece(hf.FINAL_NORM, 0, h),))

    m = _LAYER_RE.match(local)
    if m and int(m.group(1)) < layers_per_chunk(spec, ml):
        layer = layer_offset(spec, ml, pp_rank, vp_stage) + int(m.group(1))
        pre, suffix = hf.layer_prefix(layer), m.group(2)
        found = _layer_shard(spec, name, pre, suffix, t, r)
        if found is None and spec.is_moe:
            found = _expert_shard(spec, name, pre, suffix, ml.ep, ep_rank, t, r)
        if found is not None:
            return found
    raise UnknownParameterError(
        f"unknown Megatron parameter {name!r} on pipeline stage {pp_rank}, virtual stage "
        f"{vp_stage} of a {spec.family} model with {layers_per_chunk(spec, ml)} layers per chunk "
        f"(tied={spec.tie_word_embeddings}, qkv_bias={spec.qkv_bias}, qk_norm={spec.qk_norm}, "
        f"experts={spec.num_experts}/ep {ml.ep}); "
        "megatron_grpo.layouts knows the GPT local/TE spec names only."
    )


def chunk_shards(
    spec: ModelSpec, ml: MegatronLayout, pp_rank: int, vp_stage: int, tp_rank: int,
    ep_rank: int = 0,
) -> list[ShardLayout]:  # fmt: skip
    """Every parameter shard of one model chunk on one (TP, EP) rank."""
    return [
        shard(spec, ml, n, pp_rank, vp_stage, tp_rank, ep_rank)
        for n in chunk_names(spec, ml, pp_rank, vp_stage)
    ]


def is_expert(name: str) -> bool:
    """Whether Megatron parameter ``name`` belongs to one EP rank's experts (not replicated
    over the EP ranks, as everything else is)."""
    return ".mlp.experts.local_experts." in strip_wrappers(name)
