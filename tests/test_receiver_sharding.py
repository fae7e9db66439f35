"""An HF -> vLLM per-rank sharder written from vLLM's weight_loader semantics (not from
vLLM's code, and not from megatron_grpo.layouts, so it checks both independently), plus
a unit test of the checksum both sides of a verified sync compute.

vLLM semantics reproduced here (docs/layouts.md, "vLLM (0.32), per TP rank r of T"):
- ``qkv_proj`` = [this rank's q heads; its k heads; its v heads]; with T > ng each KV head
  is replicated on T/ng ranks (kv shard index = rank // (T/ng)).
- ``gate_up_proj`` = [gate rows block r; up rows block r]; ``o_proj``/``down_proj`` are split
  by columns; norms (incl. Qwen3 ``q_norm``/``k_norm``) are replicated.
- ``embed_tokens``/``lm_head``: vocabulary padded with zero rows to a multiple of 64, split
  in equal row blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_grpo.bridge.checksum import tensor_checksum


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


# ---------------------------------------------------------------------------- unit tests
def test_checksum_is_exact_and_position_sensitive() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert tensor_checksum(t) == tensor_checksum(t.clone())
    assert tensor_checksum(t) != tensor_checksum(t.flip(0))  # moved rows
    u = t.clone()
    u.view(-1).view(torch.int32)[5] ^= 1  # one flipped mantissa bit
    assert tensor_checksum(t) != tensor_checksum(u)
    assert tensor_checksum(t.t()) == tensor_checksum(t.t().contiguous())
    assert isinstance(tensor_checksum(t.to(torch.bfloat16)), int)


def test_sharder_tp_invariants(tmp_path: Path) -> None:
    from megatron_grpo.models.tiny import build_hf_model

    d = build_hf_model(tmp_path / "m", seed=0, num_key_value_heads=1, tie_word_embeddings=False)
    full = vllm_shards_from_hf(d, 1, 0)
    parts = [vllm_shards_from_hf(d, 2, r) for r in range(2)]
    # down_proj columns concatenate back; kv replicated on both ranks when T > ng.
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(torch.cat([p[name] for p in parts], 1), full[name])
    qkv = [p["model.layers.0.self_attn.qkv_proj.weight"] for p in parts]
    assert qkv[0].shape == (2 * 32 + 2 * 32, 128)
    assert torch.equal(qkv[0][64:], qkv[1][64:])
    emb = torch.cat([p["model.embed_tokens.weight"] for p in parts])
    assert emb.shape[0] == 128 and torch.equal(emb, full["model.embed_tokens.weight"])
    assert emb[87:].abs().sum() == 0
