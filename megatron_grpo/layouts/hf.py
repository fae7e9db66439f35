"""Hugging Face tensor names and shapes for the supported families.

These are the shared coordinates of every layout: Megatron and vLLM shards are both
described as slices of these tensors. Names follow transformers' Llama/Qwen2/Qwen3
modelling files (``model.layers.{i}.self_attn.q_proj.weight`` ...); Qwen3-MoE checkpoints
store one tensor per expert (``mlp.experts.{e}.gate_proj.weight``) and the router as
``mlp.gate.weight`` (transformers fuses the experts only in memory, on load); Qwen2-MoE adds
``mlp.shared_expert.*`` and its gate ``mlp.shared_expert_gate.weight``.
"""

from __future__ import annotations

from megatron_grpo.models.spec import ModelSpec

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def output_source(spec: ModelSpec) -> str:
    """The HF tensor the output layer reads: the embedding when tied (HF then has no
    ``lm_head.weight``; transformers ties it on load)."""
    return EMBED if spec.tie_word_embeddings else LM_HEAD


def hf_layer_shapes(spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """Shapes of one decoder layer's HF tensors, in checkpoint order."""
    h, hn, f = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    q, kv = spec.num_heads * hn, spec.num_kv_heads * hn
    p = layer_prefix(layer)
    out: dict[str, tuple[int, ...]] = {
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (q, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
    }
    if spec.qkv_bias:
        out[p + "self_attn.q_proj.bias"] = (q,)
        out[p + "self_attn.k_proj.bias"] = (kv,)
        out[p + "self_attn.v_proj.bias"] = (kv,)
    if spec.qk_norm:
        out[p + "self_attn.q_norm.weight"] = (hn,)
        out[p + "self_attn.k_norm.weight"] = (hn,)
    out[p + "self_attn.o_proj.weight"] = (h, q)
    out[p + "post_attention_layernorm.weight"] = (h,)
    if spec.is_moe:
        out[p + "mlp.gate.weight"] = (spec.num_experts, h)
        for e in range(spec.num_experts):
            out.update(_mlp_shapes(f"{p}mlp.experts.{e}.", spec.moe_ffn_hidden_size, h))
        if spec.shared_expert_ffn_hidden_size:  # Qwen2-MoE
            out.update(_mlp_shapes(p + "mlp.shared_expert.", spec.shared_expert_ffn_hidden_size, h))
            out[p + "mlp.shared_expert_gate.weight"] = (1, h)
    else:
        out.update(_mlp_shapes(p + "mlp.", f, h))
    return out


def _mlp_shapes(p: str, f: int, h: int) -> dict[str, tuple[int, ...]]:
    return {
        p + "gate_proj.weight": (f, h),
        p + "up_proj.weight": (f, h),
        p + "down_proj.weight": (h, f),
    }


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of the model and its shape, in a stable order (embedding, layers,
    final norm, lm_head). Tied models have no ``lm_head.weight``."""
    out: dict[str, tuple[int, ...]] = {EMBED: (spec.vocab_size, spec.hidden_size)}
    for i in range(spec.num_layers):
        out.update(hf_layer_shapes(spec, i))
    out[FINAL_NORM] = (spec.hidden_size,)
    if not spec.tie_word_embeddings:
        out[LM_HEAD] = (spec.vocab_size, spec.hidden_size)
    return out


def hf_layer_of(name: str) -> int | None:
    """Global layer index of an HF tensor name, or None for non-layer tensors."""
    if name.startswith("model.layers."):
        return int(name.split(".")[2])
    return None
