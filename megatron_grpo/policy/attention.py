"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` for megatron's
local layer spec: the ``core_attention`` submodule of ``SelfAttention``, in place of
megatron's ``DotProductAttention``, which keeps every layer's [b, heads, s, s] scores for
backward; SDPA's fused kernels never hold them. Same contract as megatron's module, packed
(``thd``) documents attending within themselves only. The contract and what it refuses:
docs/architecture-policy.md, "Attention and packing".
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F

from megatron_grpo.config.schema import ConfigError
from megatron_grpo.policy.context_parallel import context_parallel_attention
from megatron_grpo.policy.rope import apply_rope


def _unsupported(config: Any) -> str | None:
    if config.attention_dropout:
        return f"attention_dropout={config.attention_dropout} (needs 0.0)"
    if config.window_size is not None:
        return f"window_size={config.window_size} (sliding-window attention)"
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        return f"softmax_type={config.softmax_type!r} (needs 'vanilla')"
    return None


class SDPAttention(torch.nn.Module):
    """megatron ``DotProductAttention``'s interface on torch SDPA (module docstring)."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__()
        why = _unsupported(config)
        if why is None and attention_dropout:
            why = f"attention_dropout={attention_dropout} (needs 0.0)"
        if why is not None:
            raise ConfigError(
                f"model.local_attention=sdpa does not support {why}: set "
                "model.local_attention=unfused (megatron's DotProductAttention)."
            )
        self.config = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        # megatron divides the scale by layer_number under apply_query_key_layer_scaling and
        # multiplies the scores back before the softmax (FusedScaleMaskSoftmax scale=coeff):
        # the product is 1/sqrt(hn) (or config.softmax_scale) either way.
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError(
                "SDPAttention got an attention_bias: set model.local_attention=unfused "
                "(megatron's DotProductAttention refuses it as well)."
            )
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            if attention_mask is not None:
                raise ValueError(
                    "SDPAttention: packed (thd) sequences take their mask from cu_seqlens; "
                    "pass attention_mask=None."
                )
            return packed_attention(query, key, value, packed_seq_params, self.softmax_scale)
        if packed_seq_params is not None:
            raise ValueError(
                f"SDPAttention: packed_seq_params.qkv_format={packed_seq_params.qkv_format!r} "
                "is not supported; use 'thd' or no packing."
            )
        if self.config.context_parallel_size > 1:
            raise ValueError(
                f"SDPAttention: context_parallel_size={self.config.context_parallel_size} "
                "splits packed (thd) micro-batches only; set grpo.batch.pack_sequences=true."
            )
        from megatron.core.transformer.enums import AttnMaskType

        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        # [s, b, n, hn] -> [b, n, s, hn]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        if attention_mask is not None:
            mask, causal = ~attention_mask, False  # megatron: True = masked out; SDPA: keep
        else:
            mask, causal = None, mask_type == AttnMaskType.causal and q.shape[2] > 1
            if causal and q.shape[2] != k.shape[2]:
                raise ValueError(
                    f"SDPAttention: causal self-attention needs sq == sk, got "
                    f"{q.shape[2]} and {k.shape[2]}."
                )
        out = _sdpa(q, k, v, self.softmax_scale, is_causal=causal, attn_mask=mask)
        # [b, n, s, hn] -> [s, b, n * hn]
        s, b = out.shape[2], out.shape[0]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    *,
    is_causal: bool,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA over [b, n, s, hn] with GQA (KV heads dividing the query heads)."""
    gqa = q.shape[1] != k.shape[1]
    if gqa and q.shape[1] % k.shape[1]:
        raise ValueError(
            f"SDPAttention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads"
        )
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=gqa
    )


def _document_bounds(packed_seq_params: Any, total: int) -> list[int]:
    """The documents' bounds: ``packed_seq_params.bounds`` (set on the host when the pack was
    made, ``PackedRows.packed_seq_params``) or, for params built elsewhere, ``cu_seqlens_q``
    read back once (a host sync)."""
    made = getattr(packed_seq_params, "bounds", None)
    if made is not None:
        return list(made)
    cu = packed_seq_params.cu_seqlens_q
    for name in ("cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        other = getattr(packed_seq_params, name)
        if other is not None and other is not cu and not torch.equal(other.to(cu.device), cu):
            raise ValueError(
                f"SDPAttention: packed_seq_params.{name} differs from cu_seqlens_q; only "
                "self-attention over unpadded documents is supported."
            )
    bounds: list[int] = cu.tolist()
    if bounds[0] != 0 or bounds[-1] != total or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(
            f"SDPAttention: cu_seqlens_q={bounds[:8]}... must rise strictly from 0 to the "
            f"packed length {total}."
        )
    return bounds


def packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    packed_seq_params: Any,
    scale: float,
) -> torch.Tensor:
    """Block-diagonal causal attention of packed documents: query [t, nq, hn], key/value
    [t, nkv, hn], documents from ``packed_seq_params`` (``bounds``, else ``cu_seqlens_q``);
    returns [t, nq * hn]. When the params carry the pack's ``rope`` (cos, sin), q and k are
    rotated here first (``policy.rope``: the model then applied none). When they carry a
    ``cp`` shard (``policy.context_parallel``), q, k, v are this context-parallel rank's
    tokens and the documents' full context is gathered over its group."""
    t = query.shape[0]
    rope = getattr(packed_seq_params, "rope", None)
    shard = getattr(packed_seq_params, "cp", None)
    if shard is not None:
        return context_parallel_attention(query, key, value, shard, scale, rope)
    bounds = _document_bounds(packed_seq_params, t)
    if not value.is_contiguous():
        # megatron's value is a view of the layer's whole fused QKV output: saved for the
        # backward pass as it is, it would keep all of that buffer (q and k are rotated
        # into copies) alive; its own copy keeps nkv/(nq + 2 nkv) of it (bench ops, saved
        # bytes per token per layer)
        value = value.contiguous()
    if rope is not None:
        cos, sin = (x if x.dtype == query.dtype else x.to(query.dtype) for x in rope)
        query, key = apply_rope(query, cos, sin), apply_rope(key, cos, sin)
    if not query.is_cuda:
        return varlen_attention_cpu(query, key, value, bounds, scale).reshape(t, -1)
    if _VARLEN is not None:
        max_len = max(b - a for a, b in zip(bounds, bounds[1:]))
        out = _VARLEN(query, key, value, packed_seq_params.cu_seqlens_q, max_len, scale)
        if out is not None:
            return out.reshape(t, -1)
    outs = []  # a torch without varlen_attn: one SDPA call per document
    for a, b in zip(bounds, bounds[1:]):
        # [len, n, hn] -> [1, n, len, hn]
        q, k, v = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
        outs.append(_sdpa(q, k, v, scale, is_causal=b - a > 1)[0].transpose(0, 1))
    return torch.cat(outs).reshape(t, -1)


# The CPU stand-in of the varlen kernel: ONE op per layer as seen from autograd and the
# dispatcher (forward and backward each loop over the documents inside), so what surrounds
# attention does not grow with the documents in a pack, as on CUDA (bench ops counts it).
# Each document is torch's CPU flash-attention kernel, the one ``scaled_dot_product_attention``
# picks on CPU (GQA included), so the result is the same as per-document SDPA calls, bit for
# bit (tests/policy/test_attention.py).
@torch.library.custom_op("megatron_grpo::varlen_attention", mutates_args=())
def _varlen_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    outs, lses = [], []
    for a, b in zip(bounds, bounds[1:]):
        qd, kd, vd = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qd, kd, vd, 0.0, b - a > 1, attn_mask=None, scale=scale
        )
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)  # [t, nq, hn], [nq, t]


@torch.library.custom_op("megatron_grpo::varlen_attention_backward", mutates_args=())
def _varlen_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bounds: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for a, b in zip(bounds, bounds[1:]):
        doc = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (grad, q, k, v, out))
        g, qd, kd, vd, od = doc
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g, qd, kd, vd, od, lse[:, a:b].unsqueeze(0), 0.0, b - a > 1,
            attn_mask=None, scale=scale,
        )  # fmt: skip
        for full, part in zip((dq, dk, dv), grads):
            full[a:b] = part[0].transpose(0, 1)
    return dq, dk, dv


def _varlen_setup(
    ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]
) -> None:
    q, k, v, bounds, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.bounds, ctx.scale = bounds, scale


def _varlen_grad(
    ctx: Any, grad_out: torch.Tensor, _grad_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _varlen_backward(grad_out, q, k, v, out, lse, ctx.bounds, ctx.scale)
    return dq, dk, dv, None, None


_varlen_forward.register_autograd(_varlen_grad, setup_context=_varlen_setup)


def varlen_attention_cpu(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int], scale: float
) -> torch.Tensor:
    """Causal attention of each document ``[bounds[i], bounds[i+1])`` of query [t, nq, hn],
    key/value [t, nkv, hn]; [t, nq, hn]."""
    out: torch.Tensor = _varlen_forward(query, key, value, list(bounds), float(scale))[0]
    return out


VarlenFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor | None
]
"""``run(q, k, v, cu_seqlens, max_len, scale)``: [t, nq, hn], or None where the release
cannot take the scale."""


def _make_varlen_cuda() -> VarlenFn | None:
    """``torch.nn.attention.varlen.varlen_attn`` (flash attention over cu_seqlens, CUDA only)
    adapted to the signature this torch has, or None. Its keywords changed between releases:
    causality is ``is_causal=True`` in some and ``window_size=(-1, 0)`` in others; GQA and
    ``scale`` are not in every release (KV heads are then expanded, and the default scale
    1/sqrt(hn) must be the one asked for). Covered by tests/gpu/test_gpu.py
    ``test_sdpa_packed_attention_on_cuda``."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal_kw: dict[str, Any]
    if "window_size" in params:
        causal_kw = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal_kw = {"is_causal": True}
    else:
        return None

    def run(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_len: int,
        scale: float,
    ) -> torch.Tensor | None:
        kw = dict(causal_kw)
        if "scale" in params:
            kw["scale"] = scale
        elif not math.isclose(scale, 1.0 / math.sqrt(q.shape[-1])):
            return None  # this release cannot take the scale: per-document SDPA instead
        if q.shape[1] != k.shape[1]:
            if "enable_gqa" in params:
                kw["enable_gqa"] = True
            else:
                rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        # one tensor: a tuple only with return_aux, which is not passed
        return cast(torch.Tensor, varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw))

    return run


_VARLEN = _make_varlen_cuda() if torch.cuda.is_available() else None
"""The CUDA varlen route of ``packed_attention`` (None: per-document SDPA calls)."""
