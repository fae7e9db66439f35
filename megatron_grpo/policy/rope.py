"""RoPE of packed micro-batches in one pass: cos/sin built once per micro-batch from each
token's position in its document, applied to q and k by the core attention
(``policy.attention.SDPAttention``).

Why not megatron's: for packed (``thd``) input, megatron-core 0.19's
``_apply_rotary_pos_emb_thd`` (models/common/embeddings/rope_utils.py) reads ``cu_seqlens``
to the host and loops over every document (slice, cos/sin, mul/neg/cat, a
``narrow().copy_()``), twice per layer: launches and host syncs grow with the documents in a
pack (docs/benchmarks.md, "bench ops"). The math here is megatron's unfused RoPE
(``_apply_rotary_pos_emb_bshd``: ``t * cos + rotate_half(t) * sin``, cos/sin of
``outer(position, inv_freq)`` cast to t's dtype) on the same numbers, so the result is the
same bit for bit; only the positions come from the pack instead of a per-document loop.

``skip_megatron_rope_for_packed`` makes the GPTModel hand no rotary embedding to its layers
for packed input (the core attention applies it); padded rows keep megatron's RoPE. It is
installed by ``policy.kernels.apply_kernels`` (``model.kernels.packed_rope``).
"""

from __future__ import annotations

from typing import Any

import torch


class PackedRope:
    """cos/sin of a pack's positions for one model's rotary embedding."""

    def __init__(self, model: Any, device: torch.device) -> None:
        rope = model.rotary_pos_emb
        config = model.config
        unsupported = {
            "rotary_interleaved": config.rotary_interleaved,
            "seq_len_interpolation_factor": getattr(rope, "seq_len_interpolation_factor", None),
            "multi_latent_attention": config.multi_latent_attention,
        }
        bad = {k: v for k, v in unsupported.items() if v}
        if bad:
            raise ValueError(f"PackedRope supports plain RoPE only, got {bad}")
        # [rot_dim / 2], fp32: megatron builds its frequencies from the same tensor
        self.inv_freq = rope.inv_freq.to(device)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rot_dim] in ``dtype`` for token positions [T] (on the device)."""
        freqs = torch.outer(positions.to(self.inv_freq.dtype), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        return torch.cos(emb).to(dtype), torch.sin(emb).to(dtype)


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``t`` [T, heads, d] rotated: megatron's unfused RoPE (rope_utils.py
    ``_apply_rotary_pos_emb_bshd`` with ``rotate_half``) over all of a pack's tokens."""
    rot = cos.shape[-1]
    x, rest = (t, None) if rot == t.shape[-1] else (t[..., :rot], t[..., rot:])
    x1, x2 = torch.chunk(x, 2, dim=-1)
    out = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return out if rest is None else torch.cat((out, rest), dim=-1)


def skip_megatron_rope_for_packed(model: Any) -> None:
    """Make ``model`` (a GPTModel) pass no rotary embedding to its layers for packed input:
    its ``rotary_pos_emb(..., packed_seq=True)`` returns None, so megatron's attention skips
    RoPE and the core attention applies ``apply_rope`` with the pack's cos/sin. Only for a
    core attention that does so (``SDPAttention``); idempotent."""
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None or getattr(rope, "packed_by_core_attention", False):
        return
    inner = rope.forward

    def forward(*args: Any, packed_seq: bool = False, **kwargs: Any) -> Any:
        return None if packed_seq else inner(*args, packed_seq=packed_seq, **kwargs)

    rope.forward = forward
    rope.packed_by_core_attention = True
