"""How ``RolloutEngine`` (rollout/engine.py) builds and tears down a ``vllm.LLM`` in each
placement (docs/rollout.md, ``RolloutEngine``): its arguments (``llm_arguments``; the memory
ones by device: ``memory_kwargs``), the checks and environment ``external_launcher`` needs,
the CPU thread binding of a standalone TP > 1 engine, and a colocated engine's teardown that
leaves the trainer's process group alone."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import torch


def vllm_on_gpu() -> bool:
    """Whether vLLM runs on a CUDA device here (its sleep mode and memory arguments differ)."""
    return torch.cuda.is_available()


def memory_kwargs(
    on_gpu: bool, placement: str, gpu_memory_utilization: float, cpu_kv_cache_gb: float
) -> dict[str, Any]:
    """vLLM's memory arguments, the one place ``LLM(...)`` differs by device: on GPU the
    share of the device and, colocated, sleep mode (vLLM's sleep/wake are CUDA-only); on CPU
    the KV cache size (the same knob as VLLM_CPU_KVCACHE_SPACE, vllm/v1/worker/cpu_worker.py
    ``determine_available_memory`` reads ``cache_config.kv_cache_memory_bytes``).
    tests/rollout/test_rollout.py checks both sides' names against vLLM's ``EngineArgs``."""
    if on_gpu:
        return {
            "gpu_memory_utilization": gpu_memory_utilization,
            "enable_sleep_mode": placement == "colocated",
        }
    return {"kv_cache_memory_bytes": int(cpu_kv_cache_gb * 2**30)}


BACKEND_NAME = "megatron_grpo"
"""Name of the weight-transfer backend that ``megatron_grpo.bridge.vllm_plugin`` registers."""


def llm_arguments(
    model_path: str,
    placement: str,
    tp: int,
    *,
    on_gpu: bool,
    max_model_len: int,
    enforce_eager: bool,
    seed: int,
    dtype: str | None,
    logprobs_mode: str,
    gpu_memory_utilization: float,
    cpu_kv_cache_gb: float,
    routing_capture: bool,
) -> dict[str, Any]:
    """``vllm.LLM``'s arguments for ``RolloutEngine``: the model, its parallelism and
    numerics, our weight-transfer backend and worker extension, the memory by device, and
    colocated the ``external_launcher`` executor."""
    from vllm.config import WeightTransferConfig

    kwargs: dict[str, Any] = dict(
        model=model_path,
        tensor_parallel_size=tp,
        max_model_len=max_model_len,
        enforce_eager=enforce_eager,
        seed=seed,
        # bf16 is what vLLM serves on GPU; CPU kernels are verified in fp32 here.
        dtype=dtype or ("bfloat16" if on_gpu else "float32"),
        logprobs_mode="processed_logprobs" if logprobs_mode == "processed" else "raw_logprobs",
        weight_transfer_config=WeightTransferConfig(backend=BACKEND_NAME),
        # The receiver is reached by string RPCs on this extension (no pickled callables,
        # so VLLM_ALLOW_INSECURE_SERIALIZATION stays off).
        worker_extension_cls="megatron_grpo.rollout.vllm_worker.RolloutWorkerExtension",
    )
    if routing_capture:  # a cached prompt block is not forwarded, so not captured
        kwargs["enable_prefix_caching"] = False
    if not on_gpu:
        # vLLM 0.32's runner rewinds a seeded request's generator after a partial (chunked)
        # prefill with ``Generator.set_offset``, which a CPU generator refuses ("CPU
        # Generator does not use offset", gpu_model_runner._bookkeeping_sync): a step whose
        # prefills overflow the token budget would crash the engine. Whole prefills only.
        kwargs["enable_chunked_prefill"] = False
    kwargs.update(memory_kwargs(on_gpu, placement, gpu_memory_utilization, cpu_kv_cache_gb))
    if placement == "colocated":
        kwargs["distributed_executor_backend"] = "external_launcher"
    return kwargs


_ENGINE_CORE_MAIN: Any = None
"""vLLM's own ``EngineCoreProc.run_engine_core``, once ``engine_core_dies_with_parent`` wrapped it."""


def engine_core_dies_with_parent() -> None:
    """vLLM runs a standalone engine's core in a process of its own (``EngineCore``), which
    its owner stops on shutdown; an owner killed outright (kill -9, an OOM kill, a restart of
    the rank) never does, and the core outlived it holding its memory (a GPU's, so a
    restarted rank's engine would not fit). Wrapped here, the core gets SIGKILL when its
    owner dies (``platform.lifetime.die_with_parent``); its workers follow it through vLLM's
    own death pipe. Idempotent; call before ``vllm.LLM``."""
    global _ENGINE_CORE_MAIN
    from vllm.v1.engine.core import EngineCoreProc

    if _ENGINE_CORE_MAIN is None:
        _ENGINE_CORE_MAIN = EngineCoreProc.run_engine_core
        EngineCoreProc.run_engine_core = staticmethod(_run_engine_core)


def _run_engine_core(*args: Any, **kwargs: Any) -> Any:
    """The engine core's entry point in its process: armed to die with its owner first."""
    import signal

    from megatron_grpo.platform.lifetime import die_with_parent

    die_with_parent(sig=signal.SIGKILL)
    if _ENGINE_CORE_MAIN is not None:  # forked: the wrapped class came along
        return _ENGINE_CORE_MAIN(*args, **kwargs)
    from vllm.v1.engine.core import EngineCoreProc  # spawned: vLLM's class as it is

    return EngineCoreProc.run_engine_core(*args, **kwargs)


def external_launcher_replica(tp: int) -> int:
    """Check the torch.distributed world for ``external_launcher`` and set RANK/LOCAL_RANK
    where the launcher did not; returns this rank's rollout replica (``rank // tp``)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            "placement='colocated' runs vLLM inside an existing torch.distributed world "
            "(external_launcher), but no process group is initialized: call "
            "torch.distributed.init_process_group first (torchrun), or use "
            "placement='disaggregated'."
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp:
        raise ValueError(
            f"rollout.tp={tp} must divide the world size {world}: external_launcher puts "
            f"ranks [k*tp, (k+1)*tp) in rollout replica k. Set rollout.tp to a divisor of "
            f"{world}."
        )
    # vllm/v1/executor/uniproc_executor.py: ExecutorWithExternalLauncher reads RANK and
    # LOCAL_RANK from the environment (torchrun sets them; spawned processes may not).
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    if int(os.environ["RANK"]) != rank:
        raise RuntimeError(
            f"RANK={os.environ['RANK']} in the environment but torch.distributed rank is "
            f"{rank}: external_launcher would build the wrong groups; fix the launcher."
        )
    return rank // tp


def bind_cpu_threads(tp: int) -> None:
    """A standalone CPU engine with TP > 1: one block of cores per worker in
    ``VLLM_CPU_OMP_THREADS_BIND`` unless the caller set it (vLLM's NUMA auto-binding asserts
    on small machines, vllm/utils/ompmultiprocessing.py)."""
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        ncpu = len(os.sched_getaffinity(0))
        per = max(1, ncpu // tp)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            f"{r * per}-{r * per + per - 1}" if per > 1 else str(r * per) for r in range(tp)
        )


def cpu_shm_name(unique_name: str, ranks: list[int]) -> str:
    """The name of a colocated CPU engine's SHM all-reduce segments (``<name>_<rank>`` in
    /dev/shm), keyed by this job's rendezvous (``MASTER_ADDR``/``MASTER_PORT``).

    vLLM names them from ``VLLM_DIST_IDENT``, which under external_launcher is the same
    ``//`` for every job on the machine: a second TP > 1 job running at the same time, or
    a segment a killed job left behind, fails the engine with ``create shm in SHMManager
    failed. errno: 17``. No two live jobs share a rendezvous port, so a segment that already
    has this job's name was left by a dead one (:func:`name_cpu_shm_by_job` removes it)."""
    job = f"mgrpo-{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', '0')}"
    return f"{job}-{unique_name}-[{'-'.join(str(r) for r in ranks)}]-cpushm"


def name_cpu_shm_by_job() -> None:
    """Name vLLM's CPU SHM segments by the job (:func:`cpu_shm_name`) and remove a dead
    job's segment of the same name before creating this rank's; idempotent."""
    from vllm.distributed.device_communicators import cpu_communicator as cc

    cls = cc._CPUSHMDistributed
    if getattr(cls, "_mgrpo_by_job", False):
        return
    create = cls._init_cpu_shm

    def init_cpu_shm(self) -> int:
        remove_dead_segment(self.group_name, self.communicator.rank)
        return create(self)

    cls.make_group_name = staticmethod(lambda c: cpu_shm_name(c.unique_name, c.ranks))
    cls._init_cpu_shm = init_cpu_shm
    cls._mgrpo_by_job = True


def remove_dead_segment(group_name: str, rank: int) -> bool:
    """Unlink ``/dev/shm/<group_name>_<rank>`` if it exists (a dead job's, by
    :func:`cpu_shm_name`'s naming); True when there was one."""
    path = Path("/dev/shm") / f"{group_name.lstrip('/')}_{rank}"
    existed = path.exists()
    path.unlink(missing_ok=True)
    return existed


def own_cpu_shm_segment() -> Path | None:
    """This rank's /dev/shm segment of vLLM's CPU TP all-reduce, or None.

    vLLM's CPU SHM communicator (vllm/distributed/device_communicators/cpu_communicator.py,
    ``_CPUSHMDistributed``) creates one segment per TP rank, named after
    ``VLLM_DIST_IDENT`` and the group (cpu_worker.py sets the identifier from the init
    method, which under external_launcher is ``env://`` for every run), and nothing
    unlinks it: the next colocated TP>1 engine on the machine then fails with ``create
    shm in SHMManager failed. errno: 17``. Each rank unlinks its own segment at shutdown
    (the other ranks' mappings stay valid).
    """
    from vllm.distributed import parallel_state as vps

    try:
        tp = vps.get_tp_group()
    except AssertionError:  # no vLLM groups
        return None
    mod = getattr(tp.device_communicator, "dist_module", None)
    name = getattr(mod, "group_name", None)
    if not name:
        return None
    return Path("/dev/shm") / f"{name.lstrip('/')}_{tp.rank_in_group}"


def shutdown_in_process(llm: Any) -> None:
    """EngineCore.shutdown (vllm/v1/engine/core.py) minus destroying the default group:
    stop the executor and scheduler, then destroy only vLLM's own groups."""
    from vllm.distributed import parallel_state as vps

    core = llm.llm_engine.engine_core.engine_core
    core.model_executor.shutdown()
    if core.scheduler is not None:
        core.scheduler.shutdown()
    gc.unfreeze()
    vps.destroy_model_parallel()
    if vps._WORLD is not None:  # a new_group over WORLD, not WORLD itself
        vps._WORLD.destroy()
        vps._WORLD = None
