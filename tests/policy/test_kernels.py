"""The kernel seam (``policy/kernels.py``) on CPU, in one world-1 process group.

- Choices: bad values are one ConfigError line, and each choice resolves where it can run
  (Liger: CUDA + installed + local spec; compile: local spec).
- The defaults leave megatron's modules as they are (the op budget, tests/bench/test_op_budget.py,
  holds the default path to its counts).
- The swap itself, with torch's own functions in place of Liger's, is megatron's model bit
  for bit (logits and every gradient): Liger (tests/gpu/test_gpu_kernels.py) changes only the
  kernel behind the same plumbing.
- Packed RoPE on and off, and torch.compile on and off, agree within fp32 rounding.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from megatron_grpo.config import ConfigError, load_config
from megatron_grpo.config.schema import KernelsConfig, ModelConfig, OptimConfig, ParallelConfig
from megatron_grpo.models.shapes import preset_spec
from megatron_grpo.policy import kernels as K
from megatron_grpo.policy.kernels import Kernels, SwappedRMSNorm, resolve_kernels
from tests.helpers.batches import advantaged

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["model.kernels.liger=maybe"], r"^model.kernels.liger='maybe' is not one of"),
        (["model.kernels.compile=max"], r"^model.kernels.compile='max' is not one of"),
        (["model.kernels.packed_rope=perhaps"], r"^model.kernels.packed_rope='perhaps' is not"),
        (["model.kernels.liger=on", "model.kernels.compile=on"], r"both replace the local"),
        (["model.kernels.nope=1"], r"^unknown config key 'model.kernels.nope'"),
    ],
)
def test_bad_kernel_values_are_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value)


def _model(liger="auto", compile="off", packed_rope=True, **kw) -> ModelConfig:
    kernels = KernelsConfig(packed_rope=packed_rope, liger=liger, compile=compile)
    return ModelConfig(kernels=kernels, **kw)


def test_each_choice_resolves_where_it_can_run(monkeypatch):
    assert resolve_kernels(_model(), CPU) == Kernels("local", True, "lean")
    assert resolve_kernels(_model(packed_rope=False), CPU).packed_rope is False
    assert resolve_kernels(_model(local_attention="unfused"), CPU).packed_rope is False
    assert resolve_kernels(_model(compile="on"), CPU).layer_fns == "compile"
    with pytest.raises(ConfigError, match=r"^model.kernels.liger=on, but no CUDA device"):
        resolve_kernels(_model(liger="on"), CPU)
    # a CUDA device without liger-kernel: auto is off, on names the install
    monkeypatch.setattr(K, "liger_importable", lambda: False)
    assert resolve_kernels(_model(), CUDA).layer_fns == "lean"
    with pytest.raises(ConfigError, match=r"not installed: pip install 'liger-kernel==0.8.5'"):
        resolve_kernels(_model(liger="on"), CUDA)
    monkeypatch.setattr(K, "liger_importable", lambda: True)
    assert resolve_kernels(_model(), CUDA) == Kernels("local", True, "liger")
    assert resolve_kernels(_model(compile="on"), CUDA).layer_fns == "compile"  # asked for
    # Transformer-Engine's spec: Liger auto stays off, compile and Liger on are refused
    monkeypatch.setattr(K, "te_available", lambda: True)
    assert resolve_kernels(_model(), CUDA) == Kernels("transformer_engine", False, "megatron")
    with pytest.raises(ConfigError, match=r"^model.kernels.liger=on, but the spec is Transf"):
        resolve_kernels(_model(liger="on"), CUDA)
    with pytest.raises(ConfigError, match=r"^model.kernels.compile=on compiles the local"):
        resolve_kernels(_model(compile="on"), CUDA)
    assert resolve_kernels(_model(transformer_impl="local"), CUDA).layer_fns == "liger"


# ------------------------------------------------------------------ built models, world 1
@pytest.fixture(scope="module")
def ctx():
    from megatron_grpo.distributed import distributed_context

    with distributed_context(ParallelConfig(), preset_spec("tiny"), seed=7) as c:
        yield c


SPECS = {
    "tiny": lambda: preset_spec("tiny"),
    "tiny-qk-norm": lambda: dataclasses.replace(preset_spec("tiny"), qk_norm=True),  # Qwen3
    "tiny-moe": lambda: preset_spec("tiny-moe"),  # experts' MLPs swapped too
}


def _build(ctx, kernels: Kernels | None = None, model_cfg=None, spec: str = "tiny"):
    from megatron_grpo.policy.model_builder import build_model

    return build_model(SPECS[spec](), ctx, model_cfg or ModelConfig(), kernels)[0]


def _forward_backward(model, length: int):
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(3, model.vocab_size, (3, length), generator=g)
    pos = torch.arange(length).expand(3, length)
    out = model(ids, pos, None)
    (out.float() * torch.randn(out.shape, generator=g)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


def test_defaults_swap_in_the_lean_swiglu(ctx):
    from megatron.core.transformer.mlp import MLP

    model = _build(ctx)
    assert model.config.use_te_activation_func is True
    norms = [m for m in model.modules() if isinstance(m, SwappedRMSNorm)]
    assert len(norms) == 2 * 2 + 1 and {m.fn for m in norms} == {K.torch_rms_norm}
    assert all(m.activation_func is K.lean_swiglu for m in model.modules() if isinstance(m, MLP))
    megatrons = _build(ctx, Kernels("local", True, "megatron"))
    assert megatrons.config.use_te_activation_func is False
    assert sum(type(m) is torch.nn.RMSNorm for m in megatrons.modules()) == 2 * 2 + 1
    assert model.rotary_pos_emb.packed_by_core_attention  # packed RoPE on
    off = _build(ctx, model_cfg=_model(packed_rope=False))
    assert not getattr(off.rotary_pos_emb, "packed_by_core_attention", False)


@pytest.mark.parametrize("fns", ["torch", "lean"])
@pytest.mark.parametrize("spec, norms", [("tiny", 5), ("tiny-qk-norm", 9), ("tiny-moe", 9)])
def test_the_swap_with_torchs_functions_is_megatron_bit_for_bit(ctx, spec, norms, fns):
    """``torch`` (torch's functions) and ``lean`` (its SwiGLU re-run in the backward pass)."""
    from megatron.core.transformer.mlp import MLP

    ref = _build(ctx, Kernels("local", True, "megatron"), spec=spec)
    swapped = _build(ctx, Kernels("local", True, fns), spec=spec)
    assert list(swapped.state_dict()) == list(ref.state_dict())  # names, checkpoints, layouts
    swapped.load_state_dict(ref.state_dict())
    found = [m for m in swapped.modules() if isinstance(m, SwappedRMSNorm)]
    assert len(found) == norms and not any(type(m) is torch.nn.RMSNorm for m in swapped.modules())
    mlps = [m for m in swapped.modules() if isinstance(m, MLP)]
    act = {"torch": K.torch_swiglu, "lean": K.lean_swiglu}[fns]
    assert mlps and all(m.activation_func is act for m in mlps)
    out_a, grads_a = _forward_backward(ref, 13)
    out_b, grads_b = _forward_backward(swapped, 13)
    assert torch.equal(out_a, out_b)
    assert grads_a.keys() == grads_b.keys()
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    assert all(grads_a[n].abs().sum() > 0 for n in grads_a if "layernorm" in n)


@pytest.mark.slow  # inductor compiles and loads its kernels in a subprocess
@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("cc") is None, reason="torch.compile's CPU backend needs cc")
def test_compile_on_and_off_agree_within_fp32(ctx):
    ref = _build(ctx)
    compiled = _build(ctx, resolve_kernels(_model(compile="on"), CPU))
    compiled.load_state_dict(ref.state_dict())
    assert {m.fn_name for m in compiled.modules() if isinstance(m, SwappedRMSNorm)} == {"compile"}
    for length in (13, 21):  # a second length: dynamic shapes, no recompile per micro-batch
        out_a, grads_a = _forward_backward(ref, length)
        out_b, grads_b = _forward_backward(compiled, length)
        assert torch.allclose(out_a, out_b, rtol=1e-5, atol=1e-5)
        for n in grads_a:
            scale = grads_a[n].abs().max()
            assert (grads_a[n] - grads_b[n]).abs().max() <= 1e-5 * max(1.0, scale), n


def test_packed_rope_on_and_off_agree_within_fp32(ctx):
    from megatron_grpo.policy.policy import Policy

    spec = preset_spec("tiny")
    g = torch.Generator().manual_seed(3)
    lengths = [9, 4, 14, 7, 11, 5]
    ids = torch.randint(3, spec.vocab_size, (len(lengths), max(lengths)), generator=g)
    attn = (torch.arange(max(lengths)) < torch.tensor(lengths)[:, None]).float()
    batch = advantaged(ids, attention_mask=attn, loss_mask=attn,
                       advantages=torch.linspace(-1, 1, len(lengths)))  # fmt: skip
    results = {}
    state = None
    for on in (True, False):
        cfg = _model(packed_rope=on)
        models = [_build(ctx, model_cfg=cfg)]
        if state is None:
            state = {k: v.clone() if torch.is_tensor(v) else v
                     for k, v in models[0].state_dict().items()}  # fmt: skip
        models[0].load_state_dict(state)
        policy = Policy(models, ctx, spec, cfg, OptimConfig(lr=1e-3))
        assert (policy.forward.packed_rope is not None) is on  # off: megatron's per-document RoPE
        logp = policy.compute_logprobs(batch, micro_batch_size=6, token_budget=24)["logp"]
        step = policy.train_step(batch, _loss, micro_batch_size=6, token_budget=24)
        results[on] = (logp * attn, step["loss"], step["grad_norm"])
    (a, loss_a, norm_a), (b, loss_b, norm_b) = results[True], results[False]
    assert (a - b).abs().max() <= 1e-5 and a.abs().max() > 1.0
    assert abs(loss_a - loss_b) <= 1e-6 and abs(norm_a - norm_b) <= 1e-5 * norm_a


def _loss(logp, entropy, mb):
    return -(mb.advantages[:, None] * logp * mb.loss_mask).sum() / 100.0, {}
