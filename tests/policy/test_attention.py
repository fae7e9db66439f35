"""The SDPA core attention (``policy.attention``) against megatron's unfused
``DotProductAttention``, and packed (block-diagonal causal) attention against a dense float64
reference.

- Module level, no process group: ``packed_attention`` on documents packed end to end equals
  softmax(q k^T * scale + block-diagonal causal mask) v computed densely in float64, for
  grouped-query heads, in value and in gradient.
- Model level, at TP=1 and TP=2 (spawned gloo ranks): the same HF weights loaded into a
  policy with ``model.local_attention=sdpa`` and one with ``unfused`` give the same per-token
  log-probs and the same parameter gradients of a loss over them (fp32, <= 1e-5), for GQA
  with 2 KV heads and with 1 KV head (ng < tp at TP=2: ``SelfAttention`` gathers KV heads).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_grpo.algorithms.step_batch import Rows
from megatron_grpo.policy.attention import packed_attention
from tests.conftest import tiny_variant_dirs
from tests.dist_utils import run_distributed
from tests.helpers.batches import rows
from tests.helpers.numerics import dense_block_causal

TOL = 1e-5


@pytest.mark.parametrize("nkv", [4, 2, 1])
def test_packed_attention_is_block_diagonal_causal(nkv):
    g = torch.Generator().manual_seed(nkv)
    lengths = [5, 1, 9, 3]
    t, nq, hn = sum(lengths), 4, 8
    q, k, v = (
        torch.randn(t, n, hn, generator=g, dtype=torch.float64).requires_grad_(True)
        for n in (nq, nkv, nkv)
    )
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = SimpleNamespace(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
        cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
    )  # fmt: skip
    scale = 1 / math.sqrt(hn)
    out = packed_attention(q, k, v, params, scale)
    ref = dense_block_causal(q, k, v, lengths, scale)
    assert out.shape == (t, nq * hn)
    assert torch.allclose(out, ref, atol=1e-12)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-12)
    # a document's output does not depend on what is packed before it (RoPE aside, which
    # SelfAttention applies per document before this call)
    alone = packed_attention(
        q[6:15], k[6:15], v[6:15],
        SimpleNamespace(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 9], dtype=torch.int32),
                        cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None),
        scale,
    )  # fmt: skip
    assert torch.allclose(alone, out[6:15], atol=1e-12)


def test_packed_attention_refuses_bad_cu_seqlens():
    q = torch.zeros(6, 2, 4)
    bad = SimpleNamespace(
        qkv_format="thd", cu_seqlens_q=torch.tensor([0, 3, 5], dtype=torch.int32),
        cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
    )  # fmt: skip
    with pytest.raises(ValueError, match="packed length 6"):
        packed_attention(q, q, q, bad, 0.5)


# ------------------------------------------------------------- megatron, TP=1 and TP=2

VARIANTS = {"gqa2": dict(num_key_value_heads=2), "gqa1": dict(num_key_value_heads=1)}


def _batch(vocab: int) -> Rows:
    g = torch.Generator().manual_seed(0)
    lengths = [14, 6, 10]
    ids = torch.zeros(3, 14, dtype=torch.long)
    attn = torch.zeros(3, 14)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(3, vocab, (n,), generator=g)
        attn[b, :n] = 1
    return rows(ids, attn)


def _attention_worker(rank, world_size, models):
    from megatron_grpo.config.schema import ModelConfig, ParallelConfig
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.layouts import load_hf_into_megatron
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.policy import build_policy

    with distributed_context(ParallelConfig(tp=world_size), seed=1) as ctx:
        out = {}
        for name, hf_dir in models.items():
            spec = load_spec(hf_dir)
            batch = _batch(spec.vocab_size)
            ids, attn = batch.input_ids, batch.attention_mask
            w = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1)) * attn
            res = {}
            for kind in ("sdpa", "unfused"):
                policy = build_policy(
                    spec, ctx, ModelConfig(local_attention=kind), None,
                    init_weights=lambda ch, d=hf_dir, s=spec: load_hf_into_megatron(ch, d, s, ctx),
                )  # fmt: skip
                core = policy.models[0].decoder.layers[0].self_attention.core_attention
                params = [p.requires_grad_(True) for _, p in policy.named_shards()]
                pos = torch.arange(ids.shape[1]).expand_as(ids)
                logp, ent = policy.scoring.token_logprobs(
                    policy.models[0](ids, pos, None, **policy.scoring.forward_kwargs), ids,
                    policy.temperature,
                )  # fmt: skip
                loss = (w * logp).sum() + 0.1 * (w * ent).sum()
                grads = torch.autograd.grad(loss, params)
                res[kind] = {
                    "core": type(core).__name__,
                    "logp": (logp * attn).detach(),
                    "grads": [g.detach() for g in grads],
                }
            s, u = res["sdpa"], res["unfused"]
            out[name] = {
                "cores": (s["core"], u["core"]),
                "logp_err": (s["logp"] - u["logp"]).abs().max().item(),
                "grad_err": max((a - b).abs().max().item() for a, b in zip(s["grads"], u["grads"])),
                "grad_scale": max(b.abs().max().item() for b in u["grads"]),
            }
    return out


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, str]:
    return tiny_variant_dirs(tmp_path_factory, "attention", VARIANTS)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [1, 2])
def test_sdpa_matches_megatron_unfused_attention(hf_models, tp):
    for rank_out in run_distributed(_attention_worker, tp, hf_models, timeout=280):
        for name, r in rank_out.items():
            assert r["cores"] == ("SDPAttention", "DotProductAttention"), r
            assert r["logp_err"] <= TOL, (name, r)
            assert r["grad_scale"] > 1e-2, (name, r)  # the comparison sees real gradients
            assert r["grad_err"] <= TOL, (name, r)
