"""A micro-batch's tensors moved to the device in one copy.

A ``.to(device)`` per tensor is a blocking host-to-device copy each (the host waits for the
device to drain before every one: a micro-batch of a dozen tensors made a dozen syncs). Here
the tensors' bytes go into one (pinned, on CUDA) host buffer, one non-blocking copy moves
it, and the device tensors are typed views into the copy.
"""

from __future__ import annotations

import torch

_ALIGN = 16
"""Byte alignment of each tensor in the buffer (a typed view needs its offset aligned)."""


def to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``tensors`` (CPU) on ``device``, moved in one copy; same names, shapes and dtypes.

    Tensors of one dtype and shape travel stacked (one slot of the buffer, one ``unbind`` on
    arrival), so the ops around the copy grow with the kinds of tensor, not their number."""
    groups: dict[tuple[torch.dtype, tuple[int, ...]], list[str]] = {}
    for k, t in tensors.items():
        groups.setdefault((t.dtype, tuple(t.shape)), []).append(k)
    blocks = [
        torch.stack([tensors[k] for k in names]) if len(names) > 1 else tensors[names[0]]
        for names in groups.values()
    ]
    sizes: list[int] = []
    for b in blocks:  # each block's bytes, then padding to the next aligned offset
        n = b.numel() * b.element_size()
        sizes += [n, -(-n // _ALIGN) * _ALIGN - n]
    total = sum(sizes)
    host = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=device.type == "cuda")
    flats = [b.reshape(-1).view(torch.uint8) for b in blocks]
    # torch.split, not Tensor.split: the same op, and typed (torch/_tensor.py's is not).
    torch._foreach_copy_(list(torch.split(host[:total], sizes)[::2]), flats)
    moved = torch.split(host.to(device, non_blocking=True)[:total], sizes)[::2]
    out: dict[str, torch.Tensor] = {}
    for names, block, m in zip(groups.values(), blocks, moved):
        m = m.view(block.dtype).view(block.shape)
        out.update(zip(names, m.unbind(0) if len(names) > 1 else [m]))
    return {k: out[k] for k in tensors}
