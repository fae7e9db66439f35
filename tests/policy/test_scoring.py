"""The scoring seam (``policy.scoring``): the fused linear + log-prob + entropy Function equals
the output layer's logits scored by ``policy.logprob`` (values and gradients in fp32 within
1e-6 of max(1, the tensor's largest |value|),
also over a TP group of 2 and with temperature != 1), holds no [tokens, vocab] tensor (peak
bytes and aten op counts measured with a TorchDispatchMode), and a policy built with
``model.logprob_impl=fused`` gives the same log-probs and gradients as ``logits`` at
(tp, pp) = (1, 1), (2, 1), (1, 2), tied and untied, padded and packed micro-batches."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_grpo.algorithms.step_batch import AdvantagedBatch
from megatron_grpo.policy.fused_logprob import fused_logprob_entropy, fused_peak_bytes
from megatron_grpo.policy.logprob import vocab_parallel_logprob_entropy
from tests.conftest import tiny_variant_dirs
from tests.dist_utils import run_distributed
from tests.helpers.batches import advantaged
from tests.helpers.numerics import PeakBytes

VOCAB, PADDED, HIDDEN = 300, 320, 24
TOL = 1e-6


def _inputs(n: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, HIDDEN, generator=g).to(dtype)
    weight = (0.5 * torch.randn(PADDED, HIDDEN, generator=g)).to(dtype)
    target = torch.randint(0, VOCAB, (n,), generator=g)
    return hidden, weight, target


def _run(fused: bool, hidden, weight, target, *, temperature=1.0, chunk=7, group=None, start=0):
    """(logp, entropy, d/dhidden, d/dweight) of a weighted sum of logp and entropy."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    vocab = dict(vocab_start=start, vocab_size=VOCAB, group=group, temperature=temperature)
    if fused:
        logp, ent = fused_logprob_entropy(h, w, target, chunk_tokens=chunk, **vocab)
    else:
        logp, ent = vocab_parallel_logprob_entropy(h @ w.t(), target, chunk_tokens=chunk, **vocab)
    k = torch.linspace(-1, 1, logp.numel(), dtype=logp.dtype)
    ((k * logp).sum() + (k.flip(0) * ent).sum()).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def _max_diff(a, b) -> float:
    """Largest max|x - y| / max(1, max|y|) over the pairs of tensors: fp32 rounding of values
    up to ~15 (log-probs) is a few 1e-6 in absolute terms, and the two paths sum over the
    vocabulary (and the weight gradient over the chunks) in different orders."""
    return max(float((x - y).abs().max() / y.abs().max().clamp(min=1)) for x, y in zip(a, b))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_equals_logits_path(temperature):
    """Both paths are as close to the fp64 values as each other (within 1e-6 of the scale),
    and within a few fp32 roundings of each other (they sum in different orders)."""
    hidden, weight, target = _inputs(53, seed=0)
    truth = _run(False, hidden.double(), weight.double(), target, temperature=temperature)
    ref = _run(False, hidden, weight, target, temperature=temperature, chunk=10_000)
    for chunk in (1, 7, 53):
        got = _run(True, hidden, weight, target, temperature=temperature, chunk=chunk)
        for g, r, t in zip(got, ref, truth):
            assert _max_diff([g.double()], [t]) <= _max_diff([r.double()], [t]) + TOL, chunk
        assert _max_diff(ref, got) <= 4 * TOL, chunk
    assert torch.equal(got[3][VOCAB:], torch.zeros(PADDED - VOCAB, HIDDEN))  # padding rows


def test_fused_is_exact_in_float64():
    hidden, weight, target = _inputs(19, seed=1, dtype=torch.float64)
    ref = _run(False, hidden, weight, target, temperature=0.7)
    assert _max_diff(ref, _run(True, hidden, weight, target, temperature=0.7)) <= 1e-12
    hd, wd, td = (
        t.detach().requires_grad_(t.is_floating_point()) for t in (hidden, weight, target)
    )

    # gradcheck differentiates numerically per input element: a small slice (2 padding rows)
    def fn(h, w):
        return fused_logprob_entropy(
            h, w, td[:3] % 10, vocab_start=0, vocab_size=10, chunk_tokens=2, temperature=0.7
        )

    assert torch.autograd.gradcheck(fn, (hd[:3], wd[:12]))
    with pytest.raises(ValueError, match="target has 19"):
        fused_logprob_entropy(hd[:5], wd, td, vocab_start=0, vocab_size=VOCAB)


def test_bf16_matches_the_logits_path_rounding():
    """In bf16 both paths round the matmul to bf16 and score in fp32: same logp and entropy."""
    hidden, weight, target = _inputs(40, seed=2, dtype=torch.bfloat16)
    ref = _run(False, hidden, weight, target)
    got = _run(True, hidden, weight, target)
    assert _max_diff(ref[:2], got[:2]) <= 1e-5
    assert got[3].dtype == torch.bfloat16 and _max_diff(ref[2:], got[2:]) <= 1e-2


def _tp2_worker(rank: int, world: int, temperature: float):
    import torch.distributed as dist

    hidden, weight, target = _inputs(29, seed=3)
    # the second shard ends in the padding rows [VOCAB, PADDED)
    half = PADDED // 2
    shard = weight[rank * half : (rank + 1) * half]
    ref = _run(False, hidden, shard, target, temperature=temperature, group=dist.group.WORLD,
               start=rank * half)  # fmt: skip
    got = _run(True, hidden, shard, target, temperature=temperature, group=dist.group.WORLD,
               start=rank * half)  # fmt: skip
    return _max_diff(ref, got)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fused_equals_logits_path_over_a_tp_group():
    for diff in run_distributed(_tp2_worker, 2, 0.7):
        assert diff <= TOL


class OpCount(TorchDispatchMode):
    """aten ops run inside the mode, and how many of their outputs are [..., cols] with at
    least ``rows`` rows (a [tokens, vocab] tensor when ``cols`` is the vocabulary)."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.rows, self.cols, self.wide = rows, cols, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[func.__name__] += 1
        outs = out if isinstance(out, (tuple, list)) else [out]
        self.wide += sum(isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.cols
                         and t.numel() >= self.rows * self.cols for t in outs)  # fmt: skip
        return out


def measure(fused: bool, n: int, vocab: int, hidden: int, chunk: int) -> dict:
    """Peak bytes allocated, aten ops and [n, vocab] outputs of one forward + backward
    of the output layer and the scoring, for ``n`` tokens (docs/benchmarks.md)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, hidden, generator=g).requires_grad_(True)
    w = (0.1 * torch.randn(vocab, hidden, generator=g)).requires_grad_(True)
    target = torch.randint(0, vocab, (n,), generator=g)
    args = dict(vocab_start=0, vocab_size=vocab, chunk_tokens=chunk, temperature=0.7)
    with PeakBytes() as peak, OpCount(n, vocab) as ops:
        if fused:
            logp, ent = fused_logprob_entropy(h, w, target, **args)
        else:
            logp, ent = vocab_parallel_logprob_entropy(h @ w.t(), target, **args)
        (logp.sum() + ent.sum()).backward()
    return {"peak": peak.peak, "ops": sum(ops.ops.values()), "full_width": ops.wide}


@pytest.mark.parametrize("n,vocab,hidden,chunk", [(1024, 1000, 32, 64), (512, 4096, 256, 128)])
def test_fused_holds_no_tokens_by_vocab_tensor(n, vocab, hidden, chunk):
    fused = measure(True, n, vocab, hidden, chunk)
    logits = measure(False, n, vocab, hidden, chunk)
    full = n * vocab * 4
    assert fused["full_width"] == 0 and logits["full_width"] >= 2, (fused, logits)
    assert fused["peak"] <= fused_peak_bytes(n, vocab, hidden, 4), fused
    assert fused["peak"] < logits["peak"] and full < logits["peak"], (fused, logits)
    assert fused["ops"] < logits["ops"], (fused, logits)


# ------------------------------------------------------------------ a policy, end to end
VARIANTS = {
    "tied": dict(tie_word_embeddings=True, num_key_value_heads=2),
    "untied": dict(tie_word_embeddings=False, num_key_value_heads=1),
}


def _batch(vocab: int) -> AdvantagedBatch:
    g = torch.Generator().manual_seed(0)
    lengths = [12, 7, 9, 5]
    ids = torch.zeros(4, 12, dtype=torch.long)
    attn, mask = torch.zeros(4, 12), torch.zeros(4, 12)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(3, vocab, (n,), generator=g)
        attn[b, :n] = 1
        mask[b, 3:n] = 1
    return advantaged(ids, attention_mask=attn, loss_mask=mask)


def _loss(logp, entropy, mb):
    mask = mb.loss_mask
    return -(logp * mask).sum() / 24 - 0.01 * (entropy * mask).sum() / 24, {}


def _policy_worker(rank, world_size, tp, pp, hf_dir, batch):
    from megatron_grpo.config.schema import ModelConfig, OptimConfig, ParallelConfig
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.layouts import load_hf_into_megatron
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.policy import build_policy

    with distributed_context(ParallelConfig(tp=tp, pp=pp), seed=1) as ctx:
        spec = load_spec(hf_dir)
        out = {}
        for impl in ("fused", "logits"):
            policy = build_policy(
                spec, ctx, ModelConfig(logprob_impl=impl), OptimConfig(lr=1e-3),
                init_weights=lambda chunks: load_hf_into_megatron(chunks, hf_dir, spec, ctx),
                temperature=0.7,
            )  # fmt: skip
            assert policy.scoring.impl == impl
            res = {
                "padded": policy.compute_logprobs(batch, 2),
                "packed": policy.compute_logprobs(batch, 2, token_budget=20),
            }
            for how, budget in (("step_packed", 20), ("step_padded", None)):
                res[how] = policy.train_step(batch, _loss, 2, token_budget=budget)["loss"]
                res["grad_" + how] = {n: p.main_grad.clone() for n, p in policy.named_shards()}
            out[impl] = res
    return out


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    return tiny_variant_dirs(tmp_path_factory, "scoring", VARIANTS)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
@pytest.mark.parametrize("variant", ["tied", "untied"])
def test_fused_policy_equals_logits_policy(hf_dirs, tp, pp, variant):
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.policy.scoring import gpt_model_hands_over_hidden

    if not gpt_model_hands_over_hidden():
        pytest.skip("this megatron-core has no GPTModel.forward(output_processor): no fused path")

    torch.set_num_threads(1)
    batch = _batch(load_spec(hf_dirs[variant]).vocab_size)
    ranks = run_distributed(_policy_worker, tp * pp, tp, pp, hf_dirs[variant], batch, timeout=500)
    for res in ranks:
        fused, logits = res["fused"], res["logits"]
        for how in ("padded", "packed"):
            for key in ("logp", "entropy"):
                assert _max_diff([fused[how][key]], [logits[how][key]]) <= TOL, (how, key)
        for how in ("step_packed", "step_padded"):
            assert abs(fused[how] - logits[how]) <= TOL, how
            grads = fused["grad_" + how]
            assert grads.keys() == logits["grad_" + how].keys()
            for name, g in grads.items():
                assert _max_diff([g], [logits["grad_" + how][name]]) <= TOL, (how, name)
            assert any(float(g.abs().max()) > 0 for g in grads.values())


def test_auto_falls_back_to_logits_without_the_hook(monkeypatch):
    """megatron-core without GPTModel.forward(output_processor) (0.16.1): auto scores logits,
    an explicit fused is refused with the fix."""
    from megatron_grpo.config.schema import ConfigError
    from megatron_grpo.policy import scoring

    monkeypatch.setattr(scoring, "gpt_model_hands_over_hidden", lambda: True)
    assert scoring.resolve_logprob_impl("auto") == "fused"
    monkeypatch.setattr(scoring, "gpt_model_hands_over_hidden", lambda: False)
    assert scoring.resolve_logprob_impl("auto") == "logits"
    assert scoring.resolve_logprob_impl("logits") == "logits"
    with pytest.raises(ConfigError, match="set model.logprob_impl=logits"):
        scoring.resolve_logprob_impl("fused")
