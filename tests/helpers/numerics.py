"""Numeric references and probes: float32 ``t``/``close`` for the hand-derived golden
values of the algorithm tests, a CPU peak-memory probe (``PeakBytes``) and a dense
block-causal attention reference (``dense_block_causal``), and ``check_rank_step``: one
parallel rank's log-probs and step against HF's and the one-rank run's."""

from __future__ import annotations

import weakref

import pytest
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


def check_rank_step(
    res: dict,
    base: dict,
    ref: torch.Tensor,
    *,
    tol: float,
    loss_abs: float,
    label: str,
    report: list[str],
) -> None:
    """One rank's ``res`` of a parallel layout: its log-probs (``res["logp"]``) within
    ``tol`` of HF's ``ref``, its step not skipped, with the one-rank run's (``base``) loss
    and grad norm; the log-prob line goes to ``report`` under ``label``."""
    d_logp = (res["logp"] - ref).abs().max().item()
    report.append(f"{label}: logp vs HF {d_logp:.2e}")
    assert d_logp < tol, report[-1]
    metrics, want = res["metrics"], base["metrics"]
    assert metrics["skipped"] is False
    assert metrics["loss"] == pytest.approx(want["loss"], abs=loss_abs)
    assert metrics["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)


def cpu_kind() -> str:
    """Which golden table of an end-to-end run this CPU reproduces to 1e-4: ``avx512+amx``
    (Intel Xeon with AMX, e.g. Sapphire Rapids: torch's AVX-512 kernels and oneDNN's AMX
    bf16 matmuls round differently, by up to 3.7e-4 relative at step 4 of an fp32 run and
    1.8e-3 at step 1 of a bf16 one), else ``reference`` (the machines the first tables were
    recorded and checked on). Measured, not guessed: tests/e2e/test_golden.py's docstring."""
    from pathlib import Path

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    amx = " amx_tile" in flags or " amx_bf16" in flags
    return (
        "avx512+amx" if amx and torch.backends.cpu.get_cpu_capability() == "AVX512" else "reference"
    )
