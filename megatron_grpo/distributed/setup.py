"""torch.distributed + megatron-core parallel_state, initialized once, returned as one object.

``init_distributed`` starts the process group (gloo on CPU; on GPU ``cpu:gloo,cuda:nccl``,
see ``process_group_backend``; every collective bounded by ``parallel.timeout_s``), builds megatron's tensor/pipeline/data/context groups
and returns a frozen ``ParallelContext`` that callers pass on; nothing downstream reaches
for megatron's global getters to learn sizes or ranks. ``validate_parallel`` is the pure
check of a layout against a world size and a model, with errors that name the values and
the fix.

Rank order is megatron's default ``tp-cp-ep-dp-pp`` (megatron/core/parallel_state.py
``initialize_model_parallel``): TP ranks are adjacent, pipeline stages are the slowest axis.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_grpo.config.schema import ConfigError, ParallelConfig
from megatron_grpo.models.spec import ModelSpec
from megatron_grpo.platform.cpu import apply_cpu_platform


@dataclass(frozen=True)
class ParallelContext:
    """Sizes, ranks, device and process groups of this process; built by init_distributed."""

    rank: int
    world_size: int
    local_rank: int
    tp: int
    pp: int
    dp: int
    cp: int
    vpp: int | None
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int
    ep: int
    """Expert-parallel size (1 for dense models); EP ranks are a sub-axis of the DP ranks."""
    ep_rank: int
    device: torch.device
    backend: str
    tp_group: Any
    pp_group: Any
    dp_group: Any
    cp_group: Any
    dp_cp_group: Any
    """Data x context parallel group: what megatron DDP reduces gradients over."""
    mp_group: Any
    """Model-parallel (TP x PP) group: what the grad norm is summed over."""
    embd_group: Any
    """First and last pipeline stage of this TP rank (tied embeddings), or None."""
    ep_group: Any
    """The ranks that hold the other experts of this rank's MoE layers (alltoall dispatch)."""
    expt_dp_group: Any
    """The ranks that hold the same experts: what megatron DDP reduces expert gradients over."""
    pg_collection: Any
    """megatron.core.process_groups_config.ProcessGroupCollection of the groups above."""
    sequence_parallel: bool = False

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def last_stage_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's pipeline (same tp, dp, cp)."""
        return dist.get_process_group_ranks(self.pp_group)[-1] if self.pp > 1 else self.rank


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
        _check_model_split(spec, parallel.tp, parallel.pp, parallel.vpp)
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
    if parallel.sequence_parallel and not cuda:
        raise ConfigError(
            "parallel.sequence_parallel=true is a GPU memory optimisation and is not supported "
            "on CPU: set parallel.sequence_parallel=false."
        )


def _check_model_split(spec: ModelSpec, tp: int, pp: int, vpp: int | None) -> None:
    """The model's heads, query groups, FFN width and layers split evenly over tp, pp, vpp."""
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


def process_group_backend(backend: str) -> str:
    """The backend string every process group of the run is created with.

    NCCL serves CUDA tensors only, and small CPU-side collectives are everywhere (the stop
    flag before each step, DP mask counts, log-probs that ``compute_logprobs`` returns on
    the CPU, megatron's own CPU metadata): one rule for all of them is to give every group
    both backends, ``cpu:gloo,cuda:nccl``, so a collective runs on gloo for CPU tensors
    and on NCCL for CUDA tensors. Groups megatron creates with ``new_group(backend=None)``
    inherit it (torch.distributed ``_new_group_with_tag``), and object collectives pick
    the CPU backend (``_get_object_coll_device``). Emulated in the CPU suite by
    ``tests/nccl_rules.py``.
    """
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def _resolve_backend(parallel: ParallelConfig) -> str:
    if parallel.backend != "auto":
        return parallel.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def rank_device(parallel: ParallelConfig) -> torch.device:
    """The kind of device ``init_distributed`` gives a rank (cuda under nccl, else cpu), for
    checks that run before it."""
    return torch.device("cuda" if _resolve_backend(parallel) == "nccl" else "cpu")


def _init_process_group(
    pg_backend: str, timeout: timedelta, rank: int, world_size: int, store: dist.Store | None
) -> None:
    """The default process group: over ``store``'s sub-world, torchrun's environment, or a
    single in-memory process; an existing one is kept when its size matches."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(
                f"torch.distributed is already initialized with world size "
                f"{dist.get_world_size()}, but WORLD_SIZE={world_size}: call "
                "destroy_distributed() first."
            )
    elif store is not None:
        if rank >= world_size:
            raise RuntimeError(
                f"RANK={rank} is outside the trainer sub-world of {world_size} ranks: only "
                "trainer ranks call init_distributed (rollout ranks serve, rollout.server)."
            )
        dist.init_process_group(
            backend=pg_backend, timeout=timeout, rank=rank, world_size=world_size, store=store
        )
    elif "WORLD_SIZE" in os.environ:
        dist.init_process_group(
            backend=pg_backend, timeout=timeout, rank=rank, world_size=world_size
        )
    else:
        dist.init_process_group(
            backend=pg_backend, timeout=timeout, rank=0, world_size=1, store=dist.HashStore()
        )


def _context_from_megatron(
    parallel: ParallelConfig,
    rank: int,
    world_size: int,
    local_rank: int,
    dp: int,
    device: torch.device,
    backend: str,
) -> ParallelContext:
    """The ``ParallelContext`` of megatron's freshly initialized groups: the one place that
    reads megatron's global getters."""
    from megatron.core import parallel_state as mpu
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ParallelContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        tp=parallel.tp,
        pp=parallel.pp,
        dp=dp,
        cp=parallel.cp,
        vpp=parallel.vpp,
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        dp_rank=mpu.get_data_parallel_rank(),
        cp_rank=mpu.get_context_parallel_rank(),
        ep=parallel.ep,
        ep_rank=mpu.get_expert_model_parallel_rank(),
        device=device,
        backend=backend,
        tp_group=mpu.get_tensor_model_parallel_group(),
        pp_group=mpu.get_pipeline_model_parallel_group(),
        dp_group=mpu.get_data_parallel_group(),
        cp_group=mpu.get_context_parallel_group(),
        dp_cp_group=mpu.get_data_parallel_group(with_context_parallel=True),
        mp_group=mpu.get_model_parallel_group(),
        embd_group=mpu.get_embedding_group(check_initialized=False),
        ep_group=mpu.get_expert_model_parallel_group(),
        expt_dp_group=mpu.get_expert_data_parallel_group(),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        sequence_parallel=parallel.sequence_parallel,
    )


def _init_megatron(parallel: ParallelConfig, seed: int) -> None:
    """Megatron's parallel groups (any previous ones destroyed) and its RNG streams."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        distributed_timeout_minutes=max(1, math.ceil(parallel.timeout_s / 60)),
        # No extra gloo groups, on either backend: every group is created with the run's
        # backend string, "cpu:gloo,cuda:nccl" on GPU (process_group_backend), so CPU tensors
        # already have a gloo path, and the optimizer takes megatron's pg_collection, with
        # which it refuses gloo groups (policy/optimizer.py _build_optimizer).
        create_gloo_process_groups=False,
    )
    # Megatron's layers fork the "model-parallel-rng" stream (tensor_parallel/random.py);
    # it must exist before any model is built.
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def init_distributed(
    parallel: ParallelConfig,
    spec: ModelSpec | None = None,
    *,
    seed: int = 1234,
    store: dist.Store | None = None,
    world_size: int | None = None,
) -> ParallelContext:
    """Initialize torch.distributed and megatron's parallel groups; return the context.

    Reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (torchrun's
    environment). Without WORLD_SIZE it runs as a single process (an in-memory store).
    On CPU the platform layer (``megatron_grpo.platform.cpu``) is applied first.
    ``seed`` seeds megatron's model-parallel RNG tracker (per-TP-rank streams).

    ``store`` and ``world_size``: a trainer *sub-world* (disaggregated placement: the first
    ``world_size`` torchrun ranks train). The default process group is then built over
    those ranks only, from ``store``, so megatron's ``initialize_model_parallel`` (which
    sizes everything from the default group, ``megatron/core/parallel_state.py``), DDP and
    checkpoint barriers see exactly the trainer ranks, unchanged.
    """
    if not torch.cuda.is_available():
        apply_cpu_platform()

    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    dp = validate_parallel(parallel, world_size, spec)
    backend = _resolve_backend(parallel)
    pg_backend = process_group_backend(backend)
    timeout = timedelta(seconds=parallel.timeout_s)

    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    _init_process_group(pg_backend, timeout, rank, world_size, store)
    _init_megatron(parallel, seed)
    return _context_from_megatron(parallel, rank, world_size, local_rank, dp, device, backend)


@contextmanager
def distributed_context(
    parallel: ParallelConfig, spec: ModelSpec | None = None, **kwargs: Any
) -> Iterator[ParallelContext]:
    """``init_distributed(parallel, spec, **kwargs)`` for the ``with`` block, torn down by
    ``destroy_distributed`` when the block ends, by return or by raise."""
    ctx = init_distributed(parallel, spec, **kwargs)
    try:
        yield ctx
    finally:
        destroy_distributed()


def destroy_distributed() -> None:
    """Tear down megatron's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
