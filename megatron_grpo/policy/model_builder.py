"""ModelSpec + ParallelContext + ModelConfig -> megatron-core GPTModel chunks.

One ``GPTModel`` per virtual pipeline stage (a list of length ``vpp or 1``), each holding
this rank's TP shard of its layers. The mapping from the HF families:

- Llama: RMSNorm, SwiGLU (``gated_linear_unit`` + silu), RoPE, no biases, GQA.
- Qwen2: as Llama plus a bias on the fused QKV (``add_qkv_bias``).
- Qwen3: as Llama plus RMSNorm over each head's q and k (``qk_layernorm``).
- Qwen3-MoE: as Qwen3 with every MLP a megatron ``MoELayer`` (``moe_args``; docs/moe.md);
  Qwen2-MoE: as Qwen2 with MoE layers and a gated shared expert.
- tied embeddings -> ``share_embeddings_and_output_weights``.

The vocabulary is padded to ``megatron_padded_vocab(spec.vocab_size, tp, divisible_by)``;
the rows past ``spec.vocab_size`` are padding that the policy masks out of the softmax.
Layer spec: megatron's local spec on CPU, Transformer-Engine's when TE is importable and
CUDA is present (``model.transformer_impl``); the local spec's core attention is torch SDPA
(``policy.attention``) unless ``model.local_attention=unfused``; RoPE, RMSNorm and SwiGLU
kernels: ``policy.kernels``. Dtype ``auto``: fp32 on CPU, bf16 on GPU.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Any

import torch
import torch.nn.functional as F

from megatron_grpo.config.schema import ModelConfig
from megatron_grpo.distributed.setup import ParallelContext
from megatron_grpo.models.spec import ModelSpec, megatron_padded_vocab
from megatron_grpo.policy.attention import SDPAttention
from megatron_grpo.policy.kernels import (
    Kernels,
    apply_kernels,
    resolve_kernels,
)

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# TransformerConfig's fused-kernel switches, all off: the fused kernels need apex/TE/CUDA, and
# the unfused paths are exact in fp32.
FUSIONS_OFF = dict.fromkeys(
    ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
     "persist_layer_norm", "apply_rope_fusion", "gradient_accumulation_fusion",
     "cross_entropy_loss_fusion"), False)  # fmt: skip


def resolve_dtype(model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """``model.dtype``, with ``auto`` = float32 on CPU and bfloat16 on GPU.

    Every dtype runs on both devices: in bfloat16/float16 megatron's optimizer keeps fp32
    main params (``Float16OptimizerWithFloat16Params`` or the ``DistributedOptimizer``), which
    the CPU platform layer lets build on CPU, so the suite trains the GPU configuration too."""
    if model_cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[model_cfg.dtype]


class LocalRMSNorm:
    """The local spec's RMSNorm: a ``torch.nn.RMSNorm`` (what megatron's ``WrappedTorchNorm``
    builds for it) that also runs under sequence parallelism, which ``WrappedTorchNorm``
    refuses (megatron/core/transformer/torch_norm.py asserts ``not config.sequence_parallel``).

    A norm is per token, so a sequence-sharded input changes nothing in its math; what
    sequence parallelism needs of it is that its weight's gradient, which each TP rank then
    has from its own share of the tokens, is summed over the TP group. Marking the weight
    ``sequence_parallel`` asks megatron's ``finalize_model_grads`` for that all-reduce
    (distributed/finalize_model_grads.py ``_allreduce_non_tensor_model_parallel_grads``), as
    Transformer Engine's norms mark theirs. The q/k norms (Qwen3) run on the gathered
    sequence; megatron all-reduces theirs over TP by name either way."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> Any:
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        if config.sequence_parallel:
            norm.weight.sequence_parallel = True  # type: ignore[attr-defined]  # megatron reads it
        return norm


def padded_vocab_size(spec: ModelSpec, ctx: ParallelContext, model_cfg: ModelConfig) -> int:
    return megatron_padded_vocab(spec.vocab_size, ctx.tp, model_cfg.make_vocab_size_divisible_by)


def transformer_config(
    spec: ModelSpec, ctx: ParallelContext, model_cfg: ModelConfig, **extra: Any
) -> Any:
    """The megatron ``TransformerConfig`` of ``spec`` at this parallel layout; ``extra``: the
    kernels' fields (``Kernels.config_args``)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = resolve_dtype(model_cfg, ctx.device)
    on_cpu = ctx.device.type == "cpu"
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=ctx.tp,
        pipeline_model_parallel_size=ctx.pp,
        virtual_pipeline_model_parallel_size=ctx.vpp,
        context_parallel_size=ctx.cp,
        expert_model_parallel_size=ctx.ep,
        sequence_parallel=ctx.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # Micro-batches are padded to their own max length, so the pipeline must exchange
        # shapes before each send (megatron/core/pipeline_parallel/p2p_communication.py).
        variable_seq_lengths=True,
        # transformer_config.py refuses variable_seq_lengths with the default "allgather" MoE
        # dispatcher even for dense models; the dispatcher is unused here.
        moe_token_dispatcher_type="alltoall",
        use_cpu_initialization=on_cpu,
        **FUSIONS_OFF,
        **moe_args(spec, model_cfg),
        **extra,
    )


def moe_args(spec: ModelSpec, model_cfg: ModelConfig) -> dict[str, Any]:
    """TransformerConfig's MoE fields for a Qwen3-MoE / Qwen2-MoE ``spec`` (none if dense).

    HF's Qwen3-MoE router (transformers models/qwen3_moe ``Qwen3MoeTopKRouter``): softmax over
    all experts in fp32, top-k, then renormalise when ``norm_topk_prob``. megatron's
    ``topk_routing_with_score_function`` (transformer/moe/moe_utils.py) with
    ``moe_router_pre_softmax=False`` takes the top-k logits and softmaxes them, which equals
    the renormalised top-k of the full softmax; ``pre_softmax=True`` is the top-k of the full
    softmax unnormalised (``norm_topk_prob=False``). Dropless (no capacity factor), no
    grouped GEMM (SequentialMLP experts, exact in fp32 on CPU); the alltoall dispatcher is
    already set for dense models (``transformer_config``). Aux loss: ``model.moe_aux_loss_coeff``
    (0, off, by default: HF computes none without ``output_router_logits``)."""
    if not spec.is_moe:
        return {}
    coeff = model_cfg.moe_aux_loss_coeff
    return dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.moe_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_pre_softmax=not spec.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if coeff > 0 else "none",
        moe_aux_loss_coeff=coeff,
        moe_grouped_gemm=False,
        # Qwen2-MoE's shared expert: sigmoid(x @ gate) * MLP(x), added to the routed output
        # (transformer/moe/shared_experts.py SharedExpertMLP with gate=True).
        moe_shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=bool(spec.shared_expert_ffn_hidden_size),
    )


def recompute_args(model_cfg: ModelConfig, impl: str) -> dict[str, Any]:
    """TransformerConfig's activation-recompute fields for ``model.recompute``: with TE
    layers, ``full`` is megatron's (each layer recomputed from its input,
    megatron/core/recompute.py ``checkpointed_forward``, ``uniform`` with one layer per
    checkpoint; TE's linear layers stay under megatron's checkpoint, as verified on a GPU);
    with the local spec none: ``checkpoint_layers`` checkpoints the layers."""
    if model_cfg.recompute == "full" and impl == "transformer_engine":
        return dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    return {}


def checkpoint_layers(model: Any) -> int:
    """``model.recompute=full``: each transformer layer of the built chunk ``model`` runs,
    while training with gradients, under torch's non-reentrant activation checkpoint
    (``torch.utils.checkpoint``, ``use_reentrant=False``), in place of megatron's
    ``recompute_granularity=full`` (``uniform``, one layer per checkpoint); returns how many
    layers. Both keep each layer's input and recompute the layer in the backward pass; this
    one stops once the tensors the layer saves are back, and the layer's last projection
    (the local spec's fc2, a ``RowParallelLinear``), whose output nothing in the layer saves,
    runs as a stand-in that only saves its ``(input, weight)`` while recomputing
    (``_PackOnly``): megatron's linear is an autograd Function whose saved tensors are
    packed after its product ran, so without the stand-in the early stop would come after
    the product. Megatron's reentrant recompute re-ran the whole layer: 1.063x the
    padding-free HF anchor's FLOPs per token on the tiny model, 1.009x now
    (docs/benchmarks.md section 7). The same computation, so the same numbers bit for bit
    (tests/policy/test_recompute.py).

    What megatron's checkpoint did and this does not: restore the model-parallel RNG
    tracker's states for dropout in the recomputed forward; the model has no dropout
    (refused below if it had). TP/SP collectives before fc2 re-run on every rank alike;
    each pipeline stage checkpoints its own layers; MoE experts are recomputed whole (no
    stand-in). TE layers keep megatron's recompute (``recompute_args``)."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if model.config.hidden_dropout or model.config.attention_dropout:
        raise ValueError(
            "model.recompute=full recomputes layers without megatron's RNG tracker: it needs "
            "hidden_dropout = attention_dropout = 0."
        )
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.__class__ = _checkpointed(type(layer))
        fc2: Any = getattr(getattr(layer, "mlp", None), "linear_fc2", None)
        if type(fc2) is RowParallelLinear:
            fc2._forward_impl = functools.partial(_fc2_forward, fc2._forward_impl)
    return len(layers)


_RECOMPUTING = threading.local()
"""``on`` while this thread recomputes a checkpointed layer (the backward pass's thread)."""


class _Recomputing:
    """The checkpoint's recompute context (its ``context_fn``'s second)."""

    def __enter__(self) -> None:
        _RECOMPUTING.on = True

    def __exit__(self, *exc: object) -> None:
        _RECOMPUTING.on = False


def _contexts() -> tuple[contextlib.AbstractContextManager[None], _Recomputing]:
    return contextlib.nullcontext(), _Recomputing()


class _PackOnly(torch.autograd.Function):
    """fc2 while recomputing: saves what megatron's linear Function saves, ``(input,
    weight)``, in that order (the checkpoint matches recomputed tensors by order), and
    skips the product: the early stop ends the recompute at this save."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        return input.new_empty(*input.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        raise RuntimeError("the recompute's stand-in for fc2 is never differentiated")


def _fc2_forward(forward: Any, input: torch.Tensor, weight: torch.Tensor, *args: Any,
                 **kwargs: Any) -> Any:  # fmt: skip
    """A checkpointed layer's ``RowParallelLinear._forward_impl``: the stand-in while
    recomputing, else megatron's."""
    if getattr(_RECOMPUTING, "on", False):
        return _PackOnly.apply(input, weight)  # type: ignore[no-untyped-call]
    return forward(input, weight, *args, **kwargs)


_CHECKPOINTED: dict[type, type] = {}


def _checkpointed(cls: type) -> type:
    """``cls`` with a forward that runs under the non-reentrant checkpoint when training with
    gradients (one subclass per layer class, made once).
    The layer's input goes in positionally, so the checkpoint saves it through autograd
    (where ``bench ops``'s ``SavedBytes`` sees it), as megatron's saved it. Megatron's layer
    keeps its mid-layer hidden state on itself (``mlp_norm_manager``) until its next forward;
    under this checkpoint that tensor's graph holds the layer's checkpoint frame and every
    tensor recomputed into it, so the forward drops it: left, it kept 9.2 GiB of a
    16k-token Qwen2.5-1.5B step alive into the next (H200, docs/benchmarks.md section 6)."""
    if cls in _CHECKPOINTED.values():
        return cls
    if cls not in _CHECKPOINTED:

        def forward(self: Any, hidden_states: Any = None, *args: Any, **kwargs: Any) -> Any:
            def run(*a: Any, **k: Any) -> Any:
                try:
                    return super(sub, self).forward(*a, **k)  # type: ignore[arg-type]
                finally:
                    self.__dict__.pop("mlp_norm_manager", None)

            if self.training and torch.is_grad_enabled():
                from torch.utils.checkpoint import checkpoint

                return checkpoint(run, hidden_states, *args, use_reentrant=False,
                                  context_fn=_contexts, **kwargs)  # fmt: skip
            return run(hidden_states, *args, **kwargs)

        sub: type = type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward})
        _CHECKPOINTED[cls] = sub
    return _CHECKPOINTED[cls]


def cast_params_(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Put every floating-point parameter of ``model`` in ``dtype``, in place.

    megatron builds its linear layers in ``params_dtype``, but the local spec's norms without
    Apex are ``torch.nn.RMSNorm`` (megatron/core/transformer/torch_norm.py ``WrappedTorchNorm``),
    built without a dtype: a "bf16" model would keep fp32 norm weights. Mixed dtypes cost a
    cast per norm per step, and they break the optimizers' checkpoints: the fp32 norms land in
    ``fp32_from_fp32_groups``, which ``Float16OptimizerWithFloat16Params.sharded_state_dict``
    does not map (megatron/core/optimizer/optimizer.py), shifting every state id after them.
    megatron-LM's ``Float16Module`` casts the whole module for the same reason; only the
    parameters are cast here (buffers such as RoPE's frequencies stay as built). Must run
    before DDP, which builds its buffers from the parameters' dtypes."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def layer_spec(spec: ModelSpec, impl: str, local_attention: str = "sdpa") -> Any:
    """megatron's GPT layer spec for ``impl``; on the local spec, the norms are
    ``LocalRMSNorm`` and the core attention is ``policy.attention.SDPAttention`` unless
    ``local_attention="unfused"`` (megatron's ``DotProductAttention``)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.identity_op import IdentityOp

    experts = spec.num_experts or None
    if impl == "transformer_engine":
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=False, qk_layernorm=spec.qk_norm
        )
    layers = get_gpt_layer_local_spec(
        num_experts=experts,
        moe_grouped_gemm=False,
        qk_layernorm=spec.qk_norm,
        normalization="RMSNorm",
    )
    # the spec is built fresh by each call: replacing its submodules touches nothing shared
    attention = layers.submodules.self_attention.submodules
    for owner, name in ((layers.submodules, "input_layernorm"),
                        (layers.submodules, "pre_mlp_layernorm"),
                        (attention, "q_layernorm"), (attention, "k_layernorm")):  # fmt: skip
        if getattr(owner, name) is not IdentityOp:
            setattr(owner, name, LocalRMSNorm)
    if local_attention == "sdpa":
        attention.core_attention = SDPAttention
    return layers


def block_spec(layers: Any, config: Any, impl: str, vp_stage: int | None, pp_rank: int) -> Any:
    """A chunk's ``TransformerBlockSubmodules``: its layers' spec, and on the local spec the
    final norm a ``LocalRMSNorm`` (a plain layer spec would give megatron's module-level
    ``LayerNormImpl``, ``WrappedTorchNorm`` without TE, transformer/transformer_block.py)."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    if impl == "transformer_engine":
        return layers
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layers] * count, layer_norm=LocalRMSNorm)


def build_model(
    spec: ModelSpec, ctx: ParallelContext, model_cfg: ModelConfig, kernels: Kernels | None = None
) -> list[Any]:
    """Build this rank's GPTModel chunks (one per virtual pipeline stage), on ctx.device.

    ``kernels``: the layer-level kernels (``policy.kernels``; default: ``model.kernels`` and
    ``model.transformer_impl`` resolved on ctx.device, which refuses a choice that cannot run
    before anything is built). Weights are megatron's random init; load real weights with
    ``megatron_grpo.layouts.load_hf_into_megatron``.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.pipeline_parallel.utils import is_vp_first_stage, is_vp_last_stage

    kernels = kernels or resolve_kernels(model_cfg, ctx.device)
    log.info("layer kernels: %s", kernels.describe())
    config = transformer_config(spec, ctx, model_cfg, **kernels.config_args(),
                                **recompute_args(model_cfg, kernels.impl))  # fmt: skip
    layers = layer_spec(spec, kernels.impl, model_cfg.local_attention)
    vocab = padded_vocab_size(spec, ctx, model_cfg)
    chunks = []
    for vp_stage in range(ctx.vpp or 1):
        vp = vp_stage if ctx.vpp else None
        pre = ctx.is_first_stage and (vp is None or is_vp_first_stage(vp, ctx.vpp))
        post = ctx.is_last_stage and (vp is None or is_vp_last_stage(vp, ctx.vpp))
        model = GPTModel(
            config=config,
            transformer_layer_spec=block_spec(layers, config, kernels.impl, vp, ctx.pp_rank),
            vocab_size=vocab,
            max_sequence_length=spec.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=spec.rope_theta,
            pg_collection=ctx.pg_collection,
            vp_stage=vp,
        )
        model.to(ctx.device)
        cast_params_(model, config.params_dtype)
        apply_kernels(model, kernels)
        if model_cfg.recompute == "full" and kernels.impl == "local":
            checkpoint_layers(model)
        chunks.append(model)
    return chunks
