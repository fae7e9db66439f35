"""The one place layer-level kernels are chosen: which layer spec (Transformer-Engine's or
megatron's local one, ``model.transformer_impl``) and, on the local spec, which RoPE, RMSNorm
and SwiGLU run (``model.kernels``). ``resolve_kernels`` decides once, before a model is
built; ``build_model`` passes ``Kernels.config_args`` to the TransformerConfig and
``apply_kernels`` swaps each built chunk's modules. What runs where: docs/kernels.md.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_grpo.config.schema import ConfigError, ModelConfig
from megatron_grpo.policy.rope import skip_megatron_rope_for_packed

RMSNormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
"""``fn(x, weight, eps)``: an RMSNorm's math."""
SwiGLUFn = Callable[[torch.Tensor], torch.Tensor]
"""``fn(fc1 output)``: SiLU(gate) * up over megatron's one fc1 buffer."""

LIGER_PIN = "liger-kernel==0.8.5"
"""The gpu extra's Liger-Kernel (setup.py ``GPU_EXTRA``); ``liger_kernel.megatron`` and the
fused gate-up SwiGLU op are in it."""

LAYER_FNS = ("megatron", "torch", "lean", "compile", "liger")


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def liger_importable() -> bool:
    """Liger-Kernel with the ops this module calls (imports Triton: CUDA machines only)."""
    try:
        from liger_kernel.ops import LigerFusedGateUpSiLUMulFunction, LigerRMSNormFunction  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_transformer_impl(model_cfg: ModelConfig, device: torch.device) -> str:
    """``local`` or ``transformer_engine`` for ``model.transformer_impl``."""
    impl = model_cfg.transformer_impl
    usable = te_available() and device.type == "cuda"
    if impl == "auto":
        return "transformer_engine" if usable else "local"
    if impl == "transformer_engine" and not usable:
        why = "no CUDA device" if device.type != "cuda" else "transformer_engine is not installed"
        raise ConfigError(
            f"model.transformer_impl=transformer_engine, but {why}: set "
            "model.transformer_impl=auto or local."
        )
    return impl


@dataclass(frozen=True)
class Kernels:
    """The resolved choice. ``layer_fns``, who computes the local spec's RMSNorm and SwiGLU:
    ``megatron`` (its own modules, untouched), ``liger`` or ``compile`` (swapped in by
    ``apply_kernels``), ``torch`` (the same swap with torch's eager functions: megatron's
    math bit for bit, the parity reference of the others; no config value selects it), or
    ``lean`` (torch's functions, the SwiGLU recomputed in the backward pass from its input:
    megatron's math bit for bit, with less kept for the backward pass; what the local spec
    runs where neither Liger nor compile does)."""

    impl: str
    packed_rope: bool
    layer_fns: str = "megatron"

    def __post_init__(self) -> None:
        if self.layer_fns not in LAYER_FNS:
            raise ValueError(f"Kernels.layer_fns={self.layer_fns!r} is not one of {LAYER_FNS}")
        if self.layer_fns != "megatron" and self.impl != "local":
            raise ValueError(f"Kernels.layer_fns={self.layer_fns!r} needs the local spec")

    @property
    def swaps_layers(self) -> bool:
        return self.layer_fns != "megatron"

    def config_args(self) -> dict[str, Any]:
        """TransformerConfig fields. A swapped SwiGLU is the MLP's ``activation_func`` applied
        to the whole fc1 output: megatron's ``use_te_activation_func`` path
        (transformer/mlp.py ``MLP.forward``; despite its name it calls whatever the MLP's
        ``activation_func`` is, and megatron checks silu + no bias fusion for it)."""
        return {"use_te_activation_func": True} if self.swaps_layers else {}

    def describe(self) -> str:
        if self.impl != "local":
            return "Transformer-Engine spec"
        rope = "packed RoPE" if self.packed_rope else "megatron RoPE"
        return f"local spec, {rope}, RMSNorm/SwiGLU: {self.layer_fns}"


def resolve_kernels(model_cfg: ModelConfig, device: torch.device) -> Kernels:
    """``model.kernels`` and ``model.transformer_impl`` on ``device``; a choice that cannot
    run raises one ConfigError line naming the value and the fix."""
    impl = resolve_transformer_impl(model_cfg, device)
    k = model_cfg.kernels
    local = impl == "local"
    packed_rope = k.packed_rope and local and model_cfg.local_attention == "sdpa"
    if k.compile == "on":
        if not local:
            raise ConfigError(
                "model.kernels.compile=on compiles the local spec's RMSNorm and SwiGLU, but "
                "model.transformer_impl resolves to transformer_engine (its own fused layers): "
                "set model.kernels.compile=off or model.transformer_impl=local."
            )
        return Kernels(impl, packed_rope, "compile")
    if use_liger(k.liger, impl, device):
        return Kernels(impl, packed_rope, "liger")
    return Kernels(impl, packed_rope, "lean" if local else "megatron")


def use_liger(
    choice: str, impl: str, device: torch.device, key: str = "model.kernels.liger"
) -> bool:
    """Whether Liger-Kernel runs for ``choice`` (auto / on / off, the value of ``key``): CUDA,
    liger-kernel installed and a local spec; ``on`` where it cannot run raises one line.
    Also ``bench train``'s ``--liger`` for its Hugging Face side."""
    if choice == "off":
        return False
    if device.type != "cuda":
        why, fix = "no CUDA device (Liger-Kernel is Triton)", ""
    elif impl != "local":
        why, fix = "the spec is Transformer-Engine's (its norms are fused already)", ""
    elif not liger_importable():
        why, fix = (
            "liger-kernel is not installed",
            f"pip install '{LIGER_PIN}' (the gpu extra), or ",
        )
    else:
        return True
    if choice == "on":
        raise ConfigError(f"{key}=on, but {why}: {fix}set {key}=auto or off.")
    return False


# ----------------------------------------------------------------- the swapped functions
def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``torch.nn.RMSNorm``'s forward (megatron's local ``WrappedTorchNorm``)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def torch_swiglu(x: torch.Tensor) -> torch.Tensor:
    """megatron's unfused gated SiLU (transformer/mlp.py ``glu``; offset 0, no clamp)."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up


def liger_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Liger's Triton RMSNorm with ``torch.nn.RMSNorm``'s numerics: casting mode ``gemma``
    (x, weight and the product in fp32, one rounding at the end, as torch's rms_norm does;
    Liger's own Megatron adapter uses ``llama``, HF's order), offset 0 (no zero-centered
    gamma), not in place (megatron may hold the activations)."""
    from liger_kernel.ops import LigerRMSNormFunction

    if x.numel() == 0:  # no rows: no kernel to launch
        return torch_rms_norm(x, weight, eps)
    out: torch.Tensor = LigerRMSNormFunction.apply(x, weight, eps, 0.0, "gemma", False, None)
    return out


def liger_swiglu(x: torch.Tensor) -> torch.Tensor:
    """Liger's Triton SiLU-multiply reading gate and up from megatron's one fc1 buffer
    (``LigerFusedGateUpSiLUMulFunction``, the op behind ``liger_kernel.megatron``'s SwiGLU:
    no chunk copies), not in place."""
    from liger_kernel.ops import LigerFusedGateUpSiLUMulFunction

    if x.numel() == 0:  # an MoE expert that got no tokens
        return torch_swiglu(x)
    out: torch.Tensor = LigerFusedGateUpSiLUMulFunction.apply(x.reshape(-1, x.shape[-1]), False)
    return out.view(*x.shape[:-1], -1)


class _SwiGLURecomputed(torch.autograd.Function):
    """``torch_swiglu`` keeping only its input (the fc1 output) for the backward pass, which
    runs it again under autograd and differentiates that: the same ops on the same input, so
    the same values and gradients, bit for bit. megatron's SwiGLU keeps the fc1 output, SiLU's
    output and a copy of ``up`` (``x + 0.0``, transformer/mlp.py ``glu``), twice the fc1
    output's bytes (docs/benchmarks.md §7, saved bytes per token per layer)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch_swiglu(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            out = torch_swiglu(x)
        dx: torch.Tensor = torch.autograd.grad(out, x, grad)[0]
        return dx


def lean_swiglu(x: torch.Tensor) -> torch.Tensor:
    """``torch_swiglu`` keeping only the fc1 output for the backward pass."""
    out: torch.Tensor = _SwiGLURecomputed.apply(x)  # type: ignore[no-untyped-call]
    return out


@functools.cache
def layer_fns(name: str) -> tuple[RMSNormFn, SwiGLUFn]:
    """(RMSNorm fn(x, weight, eps), SwiGLU fn(x)) of ``Kernels.layer_fns`` ``name``."""
    if name == "torch":
        return torch_rms_norm, torch_swiglu
    if name == "lean":
        return torch_rms_norm, lean_swiglu
    if name == "compile":
        # dynamic: micro-batches change length every step; fullgraph: one region or an error
        def compiled(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
            return torch.compile(fn, dynamic=True, fullgraph=True)

        return compiled(torch_rms_norm), compiled(torch_swiglu)
    if name == "liger":
        return liger_rms_norm, liger_swiglu
    raise ValueError(f"no layer functions named {name!r}: one of {LAYER_FNS[1:]}")


class SwappedRMSNorm(torch.nn.Module):
    """A ``torch.nn.RMSNorm``'s weight and eps with ``fn(x, weight, eps)`` doing the math. The
    weight is the same Parameter under the same name, so state dicts, the layouts, the
    checkpoints and the optimizer see the model they saw before the swap."""

    def __init__(self, norm: torch.nn.RMSNorm, fn: RMSNormFn, fn_name: str) -> None:
        super().__init__()
        if norm.weight is None or norm.eps is None or len(norm.normalized_shape) != 1:
            raise ValueError(
                f"cannot swap {norm}: needs a weight, an eps and one normalized dimension "
                "(megatron's WrappedTorchNorm has them)"
            )
        self.weight = norm.weight
        self.eps = float(norm.eps)
        self.fn, self.fn_name = fn, fn_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, fn={self.fn_name}"


def swap_rms_norms(model: torch.nn.Module, fn: RMSNormFn, fn_name: str) -> int:
    """Every ``torch.nn.RMSNorm`` of ``model`` (layers, q/k norms, the final norm) replaced by
    a ``SwappedRMSNorm`` running ``fn``; returns how many."""
    found = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if type(child) is torch.nn.RMSNorm]  # fmt: skip
    for parent, name, child in found:
        setattr(parent, name, SwappedRMSNorm(child, fn, fn_name))
    return len(found)


def swap_swiglu(model: torch.nn.Module, fn: SwiGLUFn) -> int:
    """``fn`` as the activation of every megatron ``MLP`` in ``model`` (dense, experts, shared
    experts); returns how many. The model must be built with ``Kernels.config_args``."""
    from megatron.core.transformer.mlp import MLP

    c: Any = model.config  # megatron's TransformerConfig
    plain = (c.gated_linear_unit and c.activation_func is F.silu and not c.add_bias_linear
             and getattr(c, "glu_linear_offset", 0.0) == 0.0
             and getattr(c, "activation_func_clamp_value", None) is None)  # fmt: skip
    if not (plain and c.use_te_activation_func):
        raise ValueError(
            "swap_swiglu needs a bias-free silu GLU built with use_te_activation_func=True "
            "(Kernels.config_args)"
        )
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    for m in mlps:
        m.activation_func = fn
    return len(mlps)


def apply_kernels(model: torch.nn.Module, kernels: Kernels) -> None:
    """Give a built GPTModel chunk ``kernels``' modules, in place, before DDP wraps it."""
    if kernels.packed_rope:
        # SDPAttention applies RoPE to packed documents in one pass (policy.rope)
        skip_megatron_rope_for_packed(model)
    if kernels.swaps_layers:
        norm_fn, act_fn = layer_fns(kernels.layer_fns)
        norms = swap_rms_norms(model, norm_fn, kernels.layer_fns)
        # every MLP must take the swapped activation: with use_te_activation_func set, one
        # left on F.silu would apply it to the whole fc1 output
        if not norms or not swap_swiglu(model, act_fn):
            raise ValueError(f"{kernels.describe()}: found no RMSNorm or no MLP to swap")
