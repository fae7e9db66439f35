"""The parts that took ops and host syncs out of the step (issue 30) are exact against what
they replace, bit for bit: the packed RoPE (``policy/rope.py``) against megatron's unfused
RoPE applied document by document, the CPU varlen attention op (``policy/attention.py``)
against one SDPA call per document (values and gradients), and the foreach gradient norm
and clipping (``policy/optimizer.py``) against megatron's local multi-tensor fallbacks.
End to end, the parity, packing and golden tests run through all of them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron_grpo.policy.attention import varlen_attention_cpu
from megatron_grpo.policy.micro_batches import PackedRows
from megatron_grpo.policy.optimizer import _foreach_l2_norm, _foreach_scale
from megatron_grpo.policy.rope import PackedRope, apply_rope

BOUNDS = [0, 5, 6, 40, 41, 100]


def _rope_model(head_dim: int = 32, base: float = 10000.0):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(kv_channels=head_dim, rotary_percent=1.0, rotary_base=base,
                           use_cpu_initialization=True)  # fmt: skip
    config = SimpleNamespace(rotary_interleaved=False, multi_latent_attention=False)
    return SimpleNamespace(rotary_pos_emb=rope, config=config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rope_equals_megatron_rope_per_document(dtype):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    model = _rope_model()
    lengths = [b - a for a, b in zip(BOUNDS, BOUNDS[1:])]
    pack = PackedRows.build(torch.ones(len(lengths), max(lengths), dtype=torch.long), lengths)
    assert pack.bounds == tuple(BOUNDS) and pack.positions[5:8].tolist() == [0, 0, 1]
    t = torch.randn(BOUNDS[-1], 4, 32, dtype=dtype)
    ours = apply_rope(t, *PackedRope(model, torch.device("cpu")).cos_sin(pack.positions, dtype))
    # megatron: the RoPE table of get_emb, each document from position 0 (rope_utils.py
    # _apply_rotary_pos_emb_thd's per-document loop)
    freqs = model.rotary_pos_emb.get_freqs_non_repeated(max(lengths))
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
    ref = torch.cat([
        _apply_rotary_pos_emb_bshd(t[a:b].unsqueeze(1), emb[: b - a]).squeeze(1)
        for a, b in zip(BOUNDS, BOUNDS[1:])
    ])  # fmt: skip
    assert torch.equal(ours, ref)


def _per_document_sdpa(query, key, value, bounds, scale):
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        q, k, v = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=b - a > 1, scale=scale,
                                           enable_gqa=True)  # fmt: skip
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_attention_op_equals_sdpa_per_document(dtype):
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(BOUNDS[-1], n, 32, generator=g).to(dtype) for n in (4, 2, 2)]
    results = []
    for fn in (_per_document_sdpa, varlen_attention_cpu):
        q, k, v = (x.clone().requires_grad_(True) for x in base)
        out = fn(q, k, v, BOUNDS, 0.17)
        out.backward(torch.arange(out.numel()).reshape(out.shape).sin().to(dtype))
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for ours, ref in zip(*results):
        assert torch.equal(ours, ref)


def test_foreach_grad_norm_and_scale_equal_megatron_local_fallbacks():
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(s, generator=g) for s in ((7, 3), (5,), (2, 2, 2))]
    norm, _ = _foreach_l2_norm(0, None, [grads], False)
    # megatron/core/utils.py local_multi_tensor_l2_norm, read back to the host as it does
    ref = torch.norm(torch.tensor([[torch.norm(t) for t in grads]]))
    assert norm.shape == (1,) and torch.equal(norm[0], ref)
    scaled = [t.clone() for t in grads]
    _foreach_scale(0, None, [scaled, scaled], 0.37)
    for a, b in zip(scaled, grads):
        assert torch.equal(a, b * 0.37)
    dst = [torch.zeros_like(t) for t in grads]
    _foreach_scale(0, None, [grads, dst], 0.5)
    assert all(torch.equal(a, b * 0.5) for a, b in zip(dst, grads))
