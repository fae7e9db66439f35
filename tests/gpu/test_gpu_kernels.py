"""The kernel seam's GPU branches (``policy/kernels.py``; docs/kernels.md) on one GPU.

- ``test_liger_functions_match_torch``: Liger's RMSNorm (casting mode ``gemma``) and fused
  gate-up SwiGLU against the torch functions they replace, fp32 and bf16, values and
  gradients, each no further from a float64 reference than torch's own kernel (with slack).
- ``test_liger_policy_matches_local``: the policy with ``model.kernels.liger=on`` and with it
  off, same weights, bf16: every norm and MLP swapped, log-probs and one train step's loss
  and gradient norm within bf16 noise.
- ``test_kernel_train_step_times``: one packed train step at the Qwen2.5-0.5B shape with
  megatron's modules, Liger's, and ``torch.compile``'s (warm), seconds recorded as figures.

The Liger parts skip without CUDA or without liger-kernel (``pip install
'liger-kernel==0.8.5'``, in the gpu extra); compile's CPU parity is tests/policy/test_kernels.py."""

from __future__ import annotations

import time

import pytest
import torch

from megatron_grpo.algorithms.step_batch import AdvantagedBatch
from megatron_grpo.config.schema import KernelsConfig, ModelConfig, OptimConfig
from megatron_grpo.models.shapes import preset_spec
from megatron_grpo.policy import kernels as K
from tests.gpu.conftest import needs_cuda
from tests.helpers.batches import advantaged


def needs_liger():
    needs_cuda()
    if not K.liger_importable():
        pytest.skip("needs liger-kernel: pip install 'liger-kernel==0.8.5' (the gpu extra)")


def _err(out, ref):
    return float((out.double() - ref).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_liger_functions_match_torch(figures, dtype):
    needs_liger()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(96, 2, 896, device="cuda", generator=g).to(dtype).requires_grad_(True)
    w = (1 + 0.1 * torch.randn(896, device="cuda", generator=g)).to(dtype).requires_grad_(True)
    up = torch.randn(96, 2, 2 * 4864, device="cuda", generator=g).to(dtype).requires_grad_(True)
    cases = {
        "rms_norm": ((x, w), lambda fn, a, b: fn(a, b, 1e-6), K.torch_rms_norm, K.liger_rms_norm),
        "swiglu": ((up,), lambda fn, a: fn(a), K.torch_swiglu, K.liger_swiglu),
    }
    for name, (inputs, call, ours, liger) in cases.items():
        ref_in = [t.detach().double().requires_grad_(True) for t in inputs]
        ref = call(ours, *ref_in)
        grad = torch.randn(ref.shape, device="cuda", generator=g, dtype=torch.float64)
        ref_grads = torch.autograd.grad(ref, ref_in, grad)
        errs = {}
        for label, fn in (("torch", ours), ("liger", liger)):
            out = call(fn, *inputs)
            assert out.dtype == dtype and out.shape == ref.shape
            grads = torch.autograd.grad(out, inputs, grad.to(dtype))
            errs[label] = max([_err(out, ref)] + [_err(a, b) for a, b in zip(grads, ref_grads)])
        tag = f"liger_{name}_{str(dtype)[6:]}"
        figures[f"{tag}_max_err"], figures[f"{tag}_torch_max_err"] = errs["liger"], errs["torch"]
        slack = 1e-5 if dtype == torch.float32 else 1e-2
        assert errs["liger"] <= 2 * errs["torch"] + slack, (name, dtype, errs)


def _batch(vocab: int, rows: int = 8, width: int = 64, seed: int = 5) -> AdvantagedBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 4, width + 1, (rows,), generator=g)
    attn = (torch.arange(width) < lengths[:, None]).float()
    ids = torch.randint(3, vocab, (rows, width), generator=g) * attn.long()
    mask = attn.clone()
    mask[:, :4] = 0
    return advantaged(ids, attention_mask=attn, loss_mask=mask,
                      advantages=torch.linspace(-1, 1, rows))  # fmt: skip


def _loss(logp, entropy, mb):
    return -(mb.advantages[:, None] * logp * mb.loss_mask).sum() / 100.0, {}


def _policy(ctx, preset, liger="off", compile="off", source=None):
    from megatron_grpo.policy import build_policy

    kernels = KernelsConfig(liger=liger, compile=compile)
    cfg = ModelConfig(dtype="bfloat16", transformer_impl="local", kernels=kernels)
    policy = build_policy(preset_spec(preset), ctx, cfg, OptimConfig(lr=1e-5, clip_grad=1.0))
    if source is not None:
        policy.copy_weights_from(source)
    return policy


def test_liger_policy_matches_local(ctx, figures):
    needs_liger()
    spec = preset_spec("tiny")
    local = _policy(ctx, "tiny")
    liger = _policy(ctx, "tiny", liger="on", source=local)
    swapped = [m for m in liger.models[0].modules() if isinstance(m, K.SwappedRMSNorm)]
    assert swapped and {m.fn_name for m in swapped} == {"liger"}
    assert liger.models[0].config.use_te_activation_func
    batch = _batch(spec.vocab_size)
    m = batch.attention_mask.bool()
    m[:, 0] = False
    a = local.compute_logprobs(batch, micro_batch_size=4, token_budget=128)["logp"]
    b = liger.compute_logprobs(batch, micro_batch_size=4, token_budget=128)["logp"]
    diff = (a - b)[m].abs()
    figures["liger_vs_local_logp_bf16_max_abs"] = float(diff.max())
    assert float(diff.mean()) < 0.02 and float(diff.max()) < 0.25
    sa = local.train_step(batch, _loss, micro_batch_size=4, token_budget=128)
    sb = liger.train_step(batch, _loss, micro_batch_size=4, token_budget=128)
    assert not sa["skipped"] and not sb["skipped"]
    assert abs(sa["loss"] - sb["loss"]) <= 0.02 * abs(sa["loss"]) + 1e-3
    assert abs(sa["grad_norm"] - sb["grad_norm"]) <= 0.05 * sa["grad_norm"]


@pytest.mark.slow  # torch.compile's inductor starts its compile-worker processes
@pytest.mark.timeout(600)
def test_kernel_train_step_times(ctx, figures):
    needs_cuda()
    spec = preset_spec("Qwen2.5-0.5B")
    batch = _batch(spec.vocab_size, rows=16, width=1024)
    choices = [("megatron", {}), ("compile", {"compile": "on"})]
    if K.liger_importable():
        choices.append(("liger", {"liger": "on"}))
    for name, kw in choices:
        policy = _policy(ctx, "Qwen2.5-0.5B", **kw)
        times = []
        for _ in range(3):  # the first compiles (compile) or autotunes (Triton)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = policy.train_step(batch, _loss, micro_batch_size=16, token_budget=4096)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        assert not out["skipped"]
        figures[f"kernels_{name}_train_step_s"] = min(times[1:])
        del policy
        torch.cuda.empty_cache()
