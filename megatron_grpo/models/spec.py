"""A normalized description of a decoder model, read from a Hugging Face config.json.

``ModelSpec`` is what every other part reads (model builder, layouts, bridge, plan); none
of them look at HF config keys directly. Supported families: Llama, Qwen2 (QKV bias),
Qwen3 (QK-norm), each with GQA and tied or untied embeddings, and their mixture-of-experts
siblings Qwen3-MoE and Qwen2-MoE (every MLP a mixture of experts; Qwen2-MoE adds a gated
shared expert; docs/moe.md).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")


class UnsupportedModelError(ValueError):
    """The HF config describes a model megatron-grpo cannot build."""


@dataclass(frozen=True)
class ModelSpec:
    family: str
    """``llama``, ``qwen2`` or ``qwen3``."""
    architecture: str
    """The HF ``architectures[0]`` string (e.g. ``Qwen2ForCausalLM``)."""
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    """Query groups (KV heads); equal to num_heads without GQA."""
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    """The tokenizer-facing vocabulary in HF's embedding (no Megatron/vLLM padding)."""
    tie_word_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    qkv_bias: bool
    """Qwen2: q/k/v projections carry a bias."""
    qk_norm: bool
    """Qwen3: RMSNorm over each head's q and k (``q_norm``/``k_norm``)."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model (every MLP then ``ffn_hidden_size``)."""
    moe_topk: int = 0
    """Experts each token is routed to (HF ``num_experts_per_tok``)."""
    moe_ffn_hidden_size: int = 0
    """One expert's FFN width (HF ``moe_intermediate_size``)."""
    norm_topk_prob: bool = False
    """Renormalise the top-k routing probabilities to sum to 1 (HF ``norm_topk_prob``)."""
    shared_expert_ffn_hidden_size: int = 0
    """Qwen2-MoE: width of the shared expert every token also goes through, scaled by a
    sigmoid gate (HF ``shared_expert_intermediate_size``); 0 for none."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def num_parameters(self) -> int:
        """Parameter count of the HF model (tied embeddings counted once)."""
        h, hn, f, v = self.hidden_size, self.head_dim, self.ffn_hidden_size, self.vocab_size
        qkv = (self.num_heads + 2 * self.num_kv_heads) * hn * h
        if self.qkv_bias:
            qkv += (self.num_heads + 2 * self.num_kv_heads) * hn
        attn = qkv + self.num_heads * hn * h + (2 * hn if self.qk_norm else 0)
        mlp = (
            self.num_experts * (3 * self.moe_ffn_hidden_size * h + h) if self.is_moe else 3 * f * h
        )
        if self.shared_expert_ffn_hidden_size:
            mlp += 3 * self.shared_expert_ffn_hidden_size * h + h
        layer = attn + mlp + 2 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + h

    def to_dict(self) -> dict:
        return asdict(self)


def _rope_theta(cfg: dict, arch: str) -> float:
    """The RoPE base of an HF config, from either config.json layout.

    transformers >= 5 writes ``rope_parameters: {rope_type, rope_theta}`` and no top-level
    ``rope_theta``; older versions write ``rope_theta`` (and ``rope_scaling``). Reading only
    the top-level key silently gave 10000 for every v5 config (e.g. Qwen2.5's 1e6).
    """
    params = cfg.get("rope_parameters") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedModelError(
            f"{arch} with rope_parameters={params!r} is not supported: "
            "only plain RoPE (rope_type default) is."
        )
    if params and "rope_theta" not in params:
        raise UnsupportedModelError(
            f"{arch} with rope_parameters={params!r} is not supported: expected a flat "
            "{rope_type: default, rope_theta: ...} (per-layer-type RoPE is not)."
        )
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def spec_from_hf_config(cfg: dict) -> ModelSpec:
    """Build a ModelSpec from a parsed HF ``config.json``; raise for unsupported models."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported: megatron-grpo builds "
            f"{sorted(SUPPORTED_ARCHITECTURES)} (dense Llama/Qwen2/Qwen3, Qwen2-MoE/Qwen3-MoE)."
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    if cfg.get("rope_scaling"):
        raise UnsupportedModelError(
            f"{arch} with rope_scaling={cfg['rope_scaling']!r} is not supported: "
            "only plain RoPE (rope_scaling null) is."
        )
    rope_theta = _rope_theta(cfg, arch)
    if family == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise UnsupportedModelError(
            "LlamaForCausalLM with attention_bias or mlp_bias is not supported: "
            "set them false or use a Qwen2 model for QKV biases."
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(
            f"hidden_act={cfg.get('hidden_act')!r} is not supported: only silu (SwiGLU) is."
        )
    num_heads = cfg["num_attention_heads"]
    num_kv = cfg.get("num_key_value_heads") or num_heads
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // num_heads
    if num_heads % num_kv:
        raise UnsupportedModelError(
            f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv}."
        )
    return ModelSpec(
        **_moe_fields(cfg, arch),
        family=family,
        architecture=arch,
        hidden_size=hidden,
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        ffn_hidden_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=rope_theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        qkv_bias=family == "qwen2" or (family == "qwen2_moe" and cfg.get("qkv_bias", True)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
    )


def _moe_fields(cfg: dict, arch: str) -> dict:
    """The MoE fields of a Qwen3-MoE or Qwen2-MoE config (none for a dense one); refuses the
    layouts that megatron's uniform MoE stack cannot build (dense layers in between)."""
    if SUPPORTED_ARCHITECTURES[arch] not in MOE_FAMILIES:
        return {}
    step, dense_layers = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers") or []
    if step != 1 or dense_layers:
        raise UnsupportedModelError(
            f"{arch} with decoder_sparse_step={step}, mlp_only_layers={dense_layers} is not "
            "supported: only models whose every layer is MoE (step 1, no mlp_only_layers) are."
        )
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    topk = cfg["num_experts_per_tok"]
    if not experts or topk > experts:
        raise UnsupportedModelError(
            f"{arch} with num_experts={experts}, num_experts_per_tok={topk}: need "
            "1 <= num_experts_per_tok <= num_experts."
        )
    return dict(
        num_experts=int(experts),
        moe_topk=int(topk),
        moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_ffn_hidden_size=int(cfg.get("shared_expert_intermediate_size") or 0),
    )


def load_spec(hf_dir: str | Path) -> ModelSpec:
    """Read ``hf_dir/config.json`` into a ModelSpec."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: model.hf_path must be a Hugging Face model directory "
            "with a config.json, or a preset name."
        )
    return spec_from_hf_config(json.loads(path.read_text()))


def megatron_padded_vocab(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by * tp``.

    Same rule as Megatron-LM's ``_vocab_size_with_padding``; every TP rank holds
    ``padded / tp`` rows of the embedding and output layer, the rows past ``vocab_size`` zero.
    """
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def vllm_padded_vocab(vocab_size: int, tp: int, pad_to: int = 64) -> int:
    """vLLM's padded vocabulary for ``VocabParallelEmbedding``/``ParallelLMHead``.

    vLLM pads the vocabulary to a multiple of 64 (``DEFAULT_VOCAB_PADDING_SIZE`` in
    vllm/model_executor/layers/vocab_parallel_embedding.py) and splits the padded rows
    evenly over its TP ranks; the loader expects exactly ``vocab_size`` incoming rows.
    """
    return ((vocab_size + pad_to - 1) // pad_to) * pad_to


def check_heads(spec: ModelSpec, train_tp: int, rollout_tp: int) -> None:
    """ValueError (one line) when a tensor-parallel size cannot split the attention heads:
    Megatron splits the ``num_heads`` query heads over the trainer TP ranks, vLLM the query
    heads over the rollout TP ranks and the KV heads likewise (or replicates each KV head on
    ``rollout_tp / num_kv_heads`` ranks)."""
    h, g = spec.num_heads, spec.num_kv_heads
    if h % train_tp:
        raise ValueError(
            f"trainer tp({train_tp}) does not divide the model's {h} attention heads: pick a "
            f"tp that divides {h}."
        )
    if h % rollout_tp or (g % rollout_tp and rollout_tp % g):
        raise ValueError(
            f"rollout tp({rollout_tp}) does not split the model's {h} attention heads / {g} KV "
            f"heads (vLLM needs tp to divide {h}, and to divide {g} or be a multiple of it): "
            "pick another rollout tp."
        )
