"""torch.distributed + megatron-core parallel_state, initialized once, returned as one object.

``init_distributed`` (or ``distributed_context`` for a ``with`` block) checks the layout
(``distributed/validate.py``), starts the process group (gloo on CPU; on GPU
``cpu:gloo,cuda:nccl``, see ``process_group_backend``; every collective bounded by
``parallel.timeout_s``), builds megatron's tensor/pipeline/data/context groups and returns a
frozen ``ParallelContext`` that callers pass on; nothing downstream reaches for megatron's
global getters to learn sizes or ranks.

Rank order is megatron's default ``tp-cp-ep-dp-pp`` (megatron/core/parallel_state.py
``initialize_model_parallel``): TP ranks are adjacent, pipeline stages are the slowest axis.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_grpo.config.schema import ParallelConfig
from megatron_grpo.distributed.validate import validate_parallel
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


_ATTEMPT_KEYS = "megatron_grpo/attempts/"
_job_attempt: int | None = None
"""The job-wide attempt this process agreed in ``attempt_store`` (None before, or outside
torchrun restarts)."""


def restarts_enabled() -> bool:
    """This worker runs under torchrun ``--max-restarts`` >= 1 (TORCHELASTIC_MAX_RESTARTS)."""
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0


def node_restart_count() -> int:
    """torchrun's restart count of this node's agent (TORCHELASTIC_RESTART_COUNT; 0: first
    start). Per node: an agent whose ranks did not fail restarts them with it unchanged
    (torch/distributed/elastic/agent/server/api.py ``_invoke_run``: a membership change is not
    a retry), so across nodes it is not the attempt; ``restart_attempt`` is."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def restart_attempt() -> int:
    """The job-wide attempt of this worker (0: the job's first), as agreed through the store
    by ``attempt_store``; before that, or without it, this node's restart count."""
    return node_restart_count() if _job_attempt is None else _job_attempt


def _agree_attempt(store: Any, rank: int, world_size: int) -> int:
    """The same attempt number on every rank of this start of the worker group, however
    many restarts each node's agent counted. Rank 0 takes the next number (one more than the
    last one it published, and at least its node's count, so a failure before any rank got
    here still counts) and answers every other rank under a key named by a fresh token of
    that rank's: an answer left in the store by an earlier attempt can never be read as this
    one's (the agent's store outlives the workers)."""
    if rank != 0:
        token = uuid.uuid4().hex
        store.set(f"{_ATTEMPT_KEYS}hello_{rank}", token)
        attempt = int(store.get(f"{_ATTEMPT_KEYS}answer_{token}"))
        store.set(f"{_ATTEMPT_KEYS}ack_{attempt}_{rank}", "1")
        return attempt
    last = f"{_ATTEMPT_KEYS}last"
    attempt = node_restart_count()
    if store.check([last]):
        attempt = max(attempt, int(store.get(last)) + 1)
    store.set(last, str(attempt))
    answered: dict[int, bytes] = {}
    waiting = set(range(1, world_size))
    deadline = time.monotonic() + store.timeout.total_seconds()
    while waiting:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"attempt {attempt}: ranks {sorted(waiting)} did not reach the store within "
                f"{store.timeout}: see their logs (torchrun --log-dir)."
            )
        for r in sorted(waiting):
            if store.check([f"{_ATTEMPT_KEYS}ack_{attempt}_{r}"]):
                waiting.discard(r)
            elif store.check([f"{_ATTEMPT_KEYS}hello_{r}"]):
                token = store.get(f"{_ATTEMPT_KEYS}hello_{r}")
                if answered.get(r) != token:  # a new hello (an old one's answer is harmless)
                    store.set(f"{_ATTEMPT_KEYS}answer_{token.decode()}", str(attempt))
                    answered[r] = token
        if waiting:
            time.sleep(0.02)
    return attempt


def attempt_store(store: Any, rank: int, world_size: int) -> Any:
    """``store`` with keys of this attempt only, the attempt agreed job-wide first (every
    rank of the world calls it once per process, under torchrun ``--max-restarts``). A worker
    torchrun restarted meets its agent's store still holding the failed attempt's keys
    (torch/distributed/rendezvous.py reuses it without a prefix): gloo's mesh, or the control
    channel's inbox addresses, would name the dead ranks and be refused. The prefix is not
    the node's TORCHELASTIC_RESTART_COUNT, which differs between nodes after one node's rank
    failed (``node_restart_count``): the restarted ranks of two nodes would never meet."""
    global _job_attempt
    if not restarts_enabled():
        return store  # nothing restarts: the store holds no earlier attempt
    if _job_attempt is None:
        _job_attempt = _agree_attempt(store, rank, world_size)
    attempt = _job_attempt
    return dist.PrefixStore(f"megatron_grpo/attempt_{attempt}/", store) if attempt else store


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
    elif restarts_enabled():
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        dist.init_process_group(
            backend=pg_backend, timeout=timeout, rank=rank, world_size=world_size,
            store=attempt_store(store, rank, world_size),
        )  # fmt: skip
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
