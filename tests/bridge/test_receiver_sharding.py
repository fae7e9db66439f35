"""The HF -> vLLM per-rank sharder ``vllm_shards_from_hf`` (tests/helpers/bridge.py), written
from vLLM's weight_loader semantics (not from vLLM's code, and not from
megatron_grpo.layouts, so it checks both independently), plus a unit test of the checksum
both sides of a verified sync compute.

vLLM semantics the sharder reproduces (docs/layouts.md, "vLLM (0.32), per TP rank r of T"):
- ``qkv_proj`` = [this rank's q heads; its k heads; its v heads]; with T > ng each KV head
  is replicated on T/ng ranks (kv shard index = rank // (T/ng)).
- ``gate_up_proj`` = [gate rows block r; up rows block r]; ``o_proj``/``down_proj`` are split
  by columns; norms (incl. Qwen3 ``q_norm``/``k_norm``) are replicated.
- ``embed_tokens``/``lm_head``: vocabulary padded with zero rows to a multiple of 64, split
  in equal row blocks.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_grpo.bridge.checksum import tensor_checksum
from tests.helpers.bridge import vllm_shards_from_hf


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
