"""One exact checksum of a tensor's bytes, and the record that carries it.

The trainer side (what a sync delivered to a vLLM rank, ``bridge.weight_sync``) and the vLLM
side (what the rank holds, ``ShardReceiver.checksums``) compute it with the same function,
so ``bridge.verify.compare_checksums`` compares like with like without moving tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_CHECKSUM_CHUNK = 1 << 24
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_checksum(t: torch.Tensor) -> int:
    """Exact, order-sensitive checksum of a tensor's bytes (any device, any dtype).

    ``sum_i bits_i * (i mod 65521 + 1)`` in wrapping int64 arithmetic over the tensor's
    raw element bits: bit-identical tensors give equal values, a moved slice or a flipped
    bit changes it. Computed on the tensor's device, in chunks; trainer and receiver call the
    same function, so a sender can compare before/after without moving the tensor.
    """
    flat = t.detach().contiguous().view(-1)
    ints = flat.view(_INT_VIEW[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, ints.numel(), _CHECKSUM_CHUNK):
        chunk = ints[start : start + _CHECKSUM_CHUNK].to(torch.int64)
        w = torch.arange(start, start + chunk.numel(), device=flat.device, dtype=torch.int64)
        total += (chunk * (w % 65521 + 1)).sum()
    return int(total.item())


@dataclass(frozen=True)
class Checksum:
    """The checksum of one tensor, with the shape and dtype it was taken over."""

    value: int
    """``tensor_checksum``: exact over the raw bits."""
    shape: tuple[int, ...]
    dtype: str
    """``str(tensor.dtype)``, e.g. ``torch.float32``."""


def checksum(t: torch.Tensor) -> Checksum:
    return Checksum(tensor_checksum(t), tuple(t.shape), str(t.dtype))
