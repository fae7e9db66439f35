"""Small model specs and arange-filled weights for the layout, plan and MoE tests: any
misplaced slice shows as a wrong number (STYLE.md 7)."""

from __future__ import annotations

import torch

from megatron_grpo.layouts import hf
from megatron_grpo.models.spec import SUPPORTED_ARCHITECTURES, ModelSpec, spec_from_hf_config
from megatron_grpo.models.tiny import hf_config_dict, shape_config

ARCHITECTURES = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}


def make_spec(family="qwen2", kv=2, tied=False, vocab=77, layers=4, heads=4, hn=4, ffn=24):
    """A small model of ``family``, read from its HF config as a real one is (the family's
    QKV bias and QK-norm follow from the architecture)."""
    shape = shape_config((heads * hn, layers, heads, kv, hn, ffn, tied), ARCHITECTURES[family])
    return spec_from_hf_config(hf_config_dict(shape, vocab, max_position_embeddings=64))


def arange_hf(spec: ModelSpec) -> dict[str, torch.Tensor]:
    out, base = {}, 1.0
    for name, shape in hf.hf_shapes(spec).items():
        n = 1
        for s in shape:
            n *= s
        out[name] = torch.arange(base, base + n, dtype=torch.float64).reshape(shape)
        base += n
    return out


def moe_spec(experts=4, topk=2, moe_ffn=8, layers=2, tied=False, norm_topk_prob=True, shared=0):
    """A small Qwen3-MoE spec, or with ``shared`` a Qwen2-MoE one with a shared expert."""
    shape = dict(PRESET_SHAPE, num_experts=experts, num_experts_per_tok=topk,
                 moe_intermediate_size=moe_ffn, num_hidden_layers=layers,
                 tie_word_embeddings=tied, norm_topk_prob=norm_topk_prob)  # fmt: skip
    if shared:
        shape.update(architecture="Qwen2MoeForCausalLM", shared_expert_intermediate_size=shared)
    return spec_from_hf_config(hf_config_dict(shape, 77, max_position_embeddings=64))


PRESET_SHAPE = dict(
    architecture="Qwen3MoeForCausalLM", hidden_size=16, num_attention_heads=4,
    num_key_value_heads=2, head_dim=4, intermediate_size=24,
)  # fmt: skip


# Qwen3-MoE (QK-norm, renormalised top-k) and Qwen2-MoE (QKV bias, plain top-k of the
# softmax, a gated shared expert), both of the tiny-moe shape
MOE_VARIANTS = {
    "qwen3_moe": {},
    "qwen2_moe": dict(architecture="Qwen2MoeForCausalLM", norm_topk_prob=False,
                      shared_expert_intermediate_size=96),
}  # fmt: skip
