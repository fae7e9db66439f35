"""``parallel.sequence_parallel=true`` at TP=2 on two GPUs, the local spec (its norms are
``policy/model_builder.py`` ``LocalRMSNorm``): a packed batch's log-probs, loss and grad
norm equal TP=2 without it, fp32, over NCCL (megatron's sequence all-gathers and
reduce-scatters; on CPU, gloo: tests/policy/test_sequence_parallel.py).

Needs two CUDA devices (nccl refuses two ranks on one device); skipped with the reason
otherwise. Written with the CPU path; not yet run: the lent machines have one GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.gpu.test_gpu_context_parallel import _worker


@pytest.mark.timeout(600)
def test_sequence_parallel_equals_tp_alone_on_cuda(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices: one per TP rank (nccl refuses two ranks on one)")
    from megatron_grpo.models.tiny import build_hf_model

    hf_dir = str(tmp_path / "tiny")
    build_hf_model(hf_dir, "tiny", seed=3)
    want = run_distributed(_worker, 2, {"tp": 2}, hf_dir, timeout=280)
    got = run_distributed(_worker, 2, {"tp": 2, "sequence_parallel": True}, hf_dir, timeout=280)
    for r, w in zip(got, want):
        torch.testing.assert_close(r["logp"], w["logp"], atol=1e-4, rtol=0)
        assert r["loss"] == pytest.approx(w["loss"], abs=1e-5)
        assert r["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4)
