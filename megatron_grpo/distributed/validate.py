"""A parallel layout checked against a world size and a model, before any process group
exists: ``validate_parallel`` (sizes, device-only options, the model's split) and
``check_experts`` (the expert split), each refusal one ``ConfigError`` line that names the
values and the fix."""

from __future__ import annotations

import math

import torch

from megatron_grpo.config.schema import ConfigError, ParallelConfig
from megatron_grpo.models.spec import ModelSpec


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_parallel(
    parallel: ParallelConfig,
    world_size: int,
    spec: ModelSpec | None = None,
    *,
    has_cuda: bool | None = None,
) -> int:
    """Check a parallel layout against WORLD_SIZE and the model; return the dp size.

    Raises ``ConfigError`` naming the values and the fix. ``has_cuda`` defaults to
    ``torch.cuda.is_available()``; options that only run on GPU are refused without it.
    """
    cuda = torch.cuda.is_available() if has_cuda is None else has_cuda
    dp = _data_parallel_size(parallel, world_size)
    _check_device_options(parallel, cuda)
    if parallel.ep > 1 and (dp * parallel.cp) % parallel.ep:
        raise ConfigError(
            f"parallel.ep({parallel.ep}) does not divide dp({dp}): expert-parallel ranks are "
            f"carved from the data-parallel ranks; pick parallel.ep from {_divisors(dp)} or "
            "launch more processes."
        )
    if spec is not None:
        check_model_split(spec, parallel.tp, parallel.pp, parallel.vpp)
        check_experts(spec, parallel.ep, parallel.tp)
    return dp


def check_experts(spec: ModelSpec, ep: int, tp: int) -> None:
    """ConfigError (one line) when the experts cannot split over ``ep`` expert-parallel ranks
    and ``tp`` expert-tensor ranks, or when ``ep > 1`` is asked of a dense model."""
    if not spec.is_moe:
        if ep > 1:
            raise ConfigError(
                f"parallel.ep({ep}) > 1 needs a mixture-of-experts model, and "
                f"{spec.architecture} is dense: set parallel.ep=1."
            )
        return
    if spec.num_experts % ep:
        raise ConfigError(
            f"parallel.ep({ep}) does not divide the model's {spec.num_experts} experts: every "
            f"EP rank holds num_experts/ep of them; choose parallel.ep from "
            f"{_divisors(spec.num_experts)}."
        )
    for key, width in (("moe_intermediate_size", spec.moe_ffn_hidden_size),
                       ("shared_expert_intermediate_size", spec.shared_expert_ffn_hidden_size)):  # fmt: skip
        if width % tp:
            raise ConfigError(
                f"{key}({width}) is not divisible by parallel.tp({tp}): every TP rank holds "
                f"1/tp of each expert; choose parallel.tp from "
                f"{_divisors(math.gcd(width, spec.num_heads))}."
            )


def _data_parallel_size(parallel: ParallelConfig, world_size: int) -> int:
    """``parallel.dp``, or WORLD_SIZE over the model-parallel size when it is 0."""
    tp, pp, cp = parallel.tp, parallel.pp, parallel.cp
    model_parallel = tp * pp * cp
    sizes = f"tp({tp})*pp({pp})" + (f"*cp({cp})" if cp > 1 else "")
    if world_size < 1:
        raise ConfigError(f"WORLD_SIZE({world_size}) must be >= 1.")
    if parallel.dp == 0:
        if world_size % model_parallel:
            raise ConfigError(
                f"{sizes}={model_parallel} does not divide WORLD_SIZE({world_size}): launch a "
                f"multiple of {model_parallel} processes or pick sizes whose product divides "
                f"{world_size}."
            )
        dp = world_size // model_parallel
    else:
        dp = parallel.dp
        total = model_parallel * dp
        if total != world_size:
            fix = f"launch {total} processes"
            if world_size % model_parallel == 0:
                fix = f"set parallel.dp={world_size // model_parallel} or {fix}"
            raise ConfigError(f"{sizes}*dp({dp})={total} != WORLD_SIZE({world_size}): {fix}.")
    return dp


def _check_device_options(parallel: ParallelConfig, cuda: bool) -> None:
    """Refuse the options that only run on GPU when there is none."""
    if parallel.backend == "nccl" and not cuda:
        raise ConfigError(
            "parallel.backend='nccl' needs CUDA, and no CUDA device is available: set "
            "parallel.backend=auto (gloo on CPU)."
        )


def check_model_split(spec: ModelSpec, tp: int, pp: int, vpp: int | None) -> None:
    """The model's heads, query groups, FFN width and layers split evenly over tp, pp, vpp
    (needs no world: ``train``'s preflight makes it before the world checks)."""
    np_, ng, hn = spec.num_heads, spec.num_kv_heads, spec.head_dim
    if np_ % tp:
        raise ConfigError(
            f"num_heads({np_}) is not divisible by parallel.tp({tp}): every TP rank holds "
            f"num_heads/tp attention heads; choose parallel.tp from {_divisors(np_)}."
        )
    if ng >= tp and ng % tp:
        raise ConfigError(
            f"num_kv_heads({ng}) is not divisible by parallel.tp({tp}): every TP rank holds "
            f"num_kv_heads/tp query groups; choose parallel.tp from "
            f"{[d for d in _divisors(np_) if ng % d == 0 or d % ng == 0]}."
        )
    if ng < tp:
        # megatron/core/transformer/attention.py supports ng < tp by all-gathering the fused
        # QKV and slicing one group per tp//ng ranks: tp must be a multiple of ng, and the
        # fused output ng*(np/ng+2)*hn must split evenly over tp (ColumnParallelLinear).
        fused = ng * (np_ // ng + 2) * hn
        if tp % ng or fused % tp:
            raise ConfigError(
                f"parallel.tp({tp}) > num_kv_heads({ng}) needs tp to be a multiple of "
                f"num_kv_heads and the fused QKV width {fused} to be divisible by tp: choose "
                f"parallel.tp from {[d for d in _divisors(np_) if ng % d == 0]}."
            )
    if spec.ffn_hidden_size % tp:
        raise ConfigError(
            f"ffn_hidden_size({spec.ffn_hidden_size}) is not divisible by parallel.tp({tp}): "
            f"choose parallel.tp from {_divisors(math.gcd(spec.ffn_hidden_size, np_))}."
        )
    stages = pp * (vpp or 1)
    if spec.num_layers % stages:
        what = f"pp({pp})*vpp({vpp})={stages}" if vpp else f"parallel.pp({pp})"
        raise ConfigError(
            f"num_layers({spec.num_layers}) is not divisible by {what}: every pipeline "
            f"{'chunk' if vpp else 'stage'} holds the same number of layers; choose "
            f"{'pp*vpp' if vpp else 'parallel.pp'} from {_divisors(spec.num_layers)}."
        )
