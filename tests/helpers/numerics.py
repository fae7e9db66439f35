"""Numeric references and probes: float32 ``t``/``close`` for the hand-derived golden
values of the algorithm tests, a CPU peak-memory probe (``PeakBytes``) and a dense
block-causal attention reference (``dense_block_causal``)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def t(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().float()
    return torch.tensor(x, dtype=torch.float32)


def close(a, b, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float32), t(b), atol=tol, rtol=tol)


class PeakBytes(TorchDispatchMode):
    """Peak of the bytes held by storages that aten ops allocate inside the mode (a CPU
    stand-in for torch.cuda.max_memory_allocated)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def _free(self, ptr: int) -> None:
        self.current -= self.live.pop(ptr, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr and ptr not in self.live:
                    self.live[ptr] = st.nbytes()
                    self.current += st.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(st, self._free, ptr)
        return out


def dense_block_causal(q, k, v, lengths, scale):
    """float64 reference: [t, nq, hn] x [t, nkv, hn] with a materialized block mask."""
    t, nq, _ = q.shape
    rep = nq // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(t)
    allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(t, -1)
