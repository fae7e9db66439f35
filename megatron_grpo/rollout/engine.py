"""``RolloutEngine``: a thin layer over ``vllm.LLM`` that samples GRPO groups with logprobs,
``colocated`` (in-process inside the trainer's torch.distributed world, vLLM's
``external_launcher``) or ``disaggregated`` (vLLM's own processes). Log-probs are vLLM's
``processed`` ones for the trainer and eval (the sampled distribution, after temperature);
weights arrive through ``bridge.receiver``. ``LLM(...)``'s arguments: ``rollout.vllm_setup``;
requests and ``Sample``s: ``rollout.samples``. Placements, groups, log-probs and sleep:
docs/rollout.md, "RolloutEngine".
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from megatron_grpo.rollout.samples import Sample, samples_of, sampling_requests
from megatron_grpo.rollout.vllm_setup import (
    bind_cpu_threads,
    engine_core_dies_with_parent,
    external_launcher_replica,
    llm_arguments,
    name_cpu_shm_by_job,
    own_cpu_shm_segment,
    shutdown_in_process,
    vllm_on_gpu,
)

if TYPE_CHECKING:
    from megatron_grpo.bridge.receiver import ShardReceiver
    from megatron_grpo.config.schema import RolloutConfig

log = logging.getLogger(__name__)

Placement = Literal["colocated", "disaggregated"]
LogprobsMode = Literal["raw", "processed"]


class RolloutEngine:
    """vLLM engine for GRPO rollouts, colocated (external_launcher) or standalone.

    ``model_path``: an HF model directory. Construct via ``from_config`` in the trainer.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        placement: Placement = "colocated",
        tp: int = 1,
        max_model_len: int = 256,
        gpu_memory_utilization: float = 0.3,
        cpu_kv_cache_gb: float = 1.0,
        enforce_eager: bool = True,
        seed: int = 0,
        logprobs_mode: LogprobsMode = "raw",
        dtype: str | None = None,
        keep_weight_copies: bool = False,
        routing_capture: bool = False,
        **llm_kwargs: Any,
    ) -> None:
        from vllm import LLM

        if placement not in ("colocated", "disaggregated"):
            raise ValueError(f"placement={placement!r} must be 'colocated' or 'disaggregated'.")
        if logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode={logprobs_mode!r} must be 'raw' or 'processed'.")
        self.placement: Placement = placement
        self.tp = tp
        self.seed = seed
        self.model_path = str(model_path)
        self.replica_index = 0
        self.routing_capture = routing_capture
        on_gpu = vllm_on_gpu()
        kwargs = llm_arguments(
            self.model_path, placement, tp, on_gpu=on_gpu, max_model_len=max_model_len,
            enforce_eager=enforce_eager, seed=seed, dtype=dtype, logprobs_mode=logprobs_mode,
            gpu_memory_utilization=gpu_memory_utilization, cpu_kv_cache_gb=cpu_kv_cache_gb,
            routing_capture=routing_capture,
        )  # fmt: skip
        self._prepare_placement(on_gpu)
        if placement == "disaggregated":  # its core is a process of its own
            engine_core_dies_with_parent()
        kwargs.update(llm_kwargs)
        self.llm = LLM(**kwargs)
        self._version = 0
        self.last_update_timings: dict[str, float] = {}
        if placement == "colocated":
            # vllm/v1/engine/core_client.py: InprocClient registers a finalizer that runs
            # EngineCore.shutdown -> cleanup_dist_env_and_memory, which destroys the default
            # process group -- the trainer's. shutdown() tears vLLM down without that.
            self.llm.llm_engine.engine_core._finalizer.detach()
        if keep_weight_copies:
            self.llm.collective_rpc("mgrpo_set_keep_copies", args=(True,))
        if routing_capture:
            self.llm.collective_rpc("mgrpo_capture_routing")

    def _prepare_placement(self, on_gpu: bool) -> None:
        """Colocated: check the torch.distributed world (this rank's replica) and, on CPU,
        name vLLM's shared-memory segment by the job; standalone on CPU: bind the workers'
        threads."""
        if self.placement == "colocated":
            self.replica_index = external_launcher_replica(self.tp)
            if not on_gpu:
                name_cpu_shm_by_job()
        elif not on_gpu:
            bind_cpu_threads(self.tp)

    @classmethod
    def from_config(
        cls, model_path: str | Path, cfg: RolloutConfig, **kwargs: Any
    ) -> RolloutEngine:
        """The trainer's and eval's engine: processed log-probs (the sampled distribution,
        ``softmax(logits / rollout.temperature)``), which the policy matches by dividing its
        logits by the same T (policy/policy.py)."""
        kwargs.setdefault("logprobs_mode", "processed")
        kwargs.setdefault("routing_capture", cfg.routing_replay != "off")
        kwargs.setdefault("enable_expert_parallel", cfg.expert_parallel)  # vLLM's EP = its TP
        return cls(
            model_path,
            placement=cfg.placement,
            tp=cfg.tp,
            max_model_len=cfg.max_model_len,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            cpu_kv_cache_gb=cfg.cpu_kv_cache_gb,
            enforce_eager=cfg.enforce_eager,
            seed=cfg.seed,
            **kwargs,
        )

    @property
    def is_colocated(self) -> bool:
        return self.placement == "colocated"

    # ------------------------------------------------------------------ sampling
    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        max_new_tokens: int = 16,
        seed: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        seeds: Sequence[int] | None = None,
        stop: Sequence[str] | None = None,
        max_tokens_each: Sequence[int] | None = None,
    ) -> list[Sample]:
        """``n`` samples per prompt, prompt-major (samples of prompt i at ``[i*n, (i+1)*n)``).

        Determinism: request i gets seed ``seed + i*n`` (its n children ``+0..n-1``,
        ``vllm/v1/engine/parallel_sampling.py``), offset per rollout replica, so the same
        seed and prompts give the same samples and no two samples share a seed. ``seeds``
        (one per prompt) replaces ``seed + i*n``: one call can then carry several steps'
        prompts, each request with the seed its own step's call would give it
        (rollout/ahead.py). ``stop`` and ``max_tokens_each``: a multi-turn episode's turn
        (``rollout.agent``; ``rollout.samples.sampling_requests``).
        """
        requests, params = sampling_requests(
            prompt_token_ids, seeds, self.seed if seed is None else seed, self.replica_index,
            n=n, temperature=temperature, top_p=top_p, top_k=top_k,
            max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, stop=stop,
            max_tokens_each=max_tokens_each,
        )  # fmt: skip
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        routed = None
        if self.routing_capture:  # rank 0's: every TP rank routes alike
            from megatron_grpo.rollout.routing_capture import take_routed

            routed = take_routed(self.llm)
        return samples_of(requests, outputs, str(self._version), routed)

    def prompt_logprobs(self, seqs: Sequence[Sequence[int]]) -> list[list[float]]:
        """Logprob of every token of each sequence given its prefix (``len(seq) - 1`` values,
        for tokens 1..L-1), under the served weights. For verification of weight syncs."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        outs = self.llm.generate(
            [{"prompt_token_ids": list(s)} for s in seqs], params, use_tqdm=False
        )
        result = []
        for seq, out in zip(seqs, outs):
            plp = out.prompt_logprobs or []
            result.append([plp[t][tok].logprob for t, tok in enumerate(seq) if t > 0])
        return result

    # ------------------------------------------------------------------ memory
    def sleep(self, level: int = 1) -> None:
        """Free vLLM's GPU memory while the trainer trains (no-op on CPU).

        Level 1 offloads the weights to CPU and drops the KV cache; level 2 drops both
        (vllm/entrypoints/llm.py ``LLM.sleep``; the memory is vLLM's CuMemAllocator pools,
        vllm/device_allocator/cumem.py). Needs ``enable_sleep_mode`` (set for colocated
        engines on GPU)."""
        if not vllm_on_gpu():
            log.info("rollout: sleep() is a no-op on CPU (vLLM has no sleep mode there).")
            return
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate what ``sleep`` freed: ``tags=["weights"]`` first (the weight sync
        writes into them), ``["kv_cache"]`` just before generating; None: everything."""
        if not vllm_on_gpu():
            log.info("rollout: wake_up() is a no-op on CPU.")
            return
        self.llm.wake_up(tags=tags)

    # ------------------------------------------------------------------ weights
    @property
    def weight_version(self) -> int:
        """Number of completed weight updates (0 = the checkpoint the engine started with)."""
        return self._version

    def _in_process_worker(self) -> Any:
        if not self.is_colocated:
            raise RuntimeError(
                "in-process weight loading needs placement='colocated'; a disaggregated engine "
                "receives weights over torch.distributed (RolloutEngine.update_weights_remote)."
            )
        # vllm/v1/executor/uniproc_executor.py: the one worker lives in this process.
        return self.llm.llm_engine.model_executor.driver_worker.worker

    @property
    def receiver(self) -> ShardReceiver:
        """This process's ``ShardReceiver`` (colocated only)."""
        return self._in_process_worker().weight_transfer_engine.receiver

    def load_shards(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Colocated: load this rank's already sharded vLLM-layout tensors, in process, through
        vLLM's reload path (start -> update -> finish). Returns the new weight version."""
        worker = self._in_process_worker()
        self._run_update(worker, lambda rx: rx.receive_shards(named_tensors))
        return self._version

    def begin_weight_update(self, record_checksums: bool = True) -> ShardReceiver:
        """Colocated: open vLLM's reload protocol on this rank's worker and return its
        receiver; feed it shards (``receive_shard``), then call ``finish_weight_update``.
        Used by the resharding bridge, whose transport hands over shards as they complete.
        ``record_checksums=False`` skips recording the repacked parameters' checksums
        (``ShardReceiver.record_checksums``) when nobody will verify this update."""
        from vllm.config import set_current_vllm_config

        worker = self._in_process_worker()
        worker.weight_transfer_engine.receiver.record_checksums = record_checksums
        worker.start_weight_update()
        self._update_ctx = set_current_vllm_config(worker.vllm_config)
        self._update_ctx.__enter__()
        return worker.weight_transfer_engine.receiver

    def finish_weight_update(self) -> float:
        """Close the reload protocol opened by ``begin_weight_update`` (vLLM re-runs its
        post-load processing); returns the seconds it took."""
        t0 = time.perf_counter()
        worker = self._in_process_worker()
        try:
            self._update_ctx.__exit__(None, None, None)
        finally:
            worker.finish_weight_update()
        self._after_update()
        return time.perf_counter() - t0

    def begin_hf_update(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Colocated: load full (unsharded) HF-named tensors through vLLM's own narrowing
        loaders (the receiver's non-presharded session, bridge/receiver.py), fed from memory;
        ``finish_hf_update`` closes it. The baseline sync's vLLM side (bridge/baseline.py)."""
        from vllm.config import set_current_vllm_config

        worker = self._in_process_worker()
        rx = worker.weight_transfer_engine.receiver
        self._update_ctx = set_current_vllm_config(worker.vllm_config)
        self._update_ctx.__enter__()
        rx.start(presharded=False)
        rx.model.load_weights(tensors)

    def finish_hf_update(self) -> None:
        """Close what ``begin_hf_update`` opened (vLLM's post-load processing runs)."""
        worker = self._in_process_worker()
        try:
            worker.weight_transfer_engine.receiver.finish()
        finally:
            self._update_ctx.__exit__(None, None, None)
        self._after_update()

    def _run_update(self, worker: Any, body: Any) -> None:
        from vllm.config import set_current_vllm_config

        worker.weight_transfer_engine.receiver.record_checksums = True
        worker.start_weight_update()
        try:
            with set_current_vllm_config(worker.vllm_config):
                body(worker.weight_transfer_engine.receiver)
        finally:
            worker.finish_weight_update()
        self._after_update()

    def _after_update(self) -> None:
        self._version += 1
        # KV blocks cached for old weights must not serve new requests.
        t0 = time.perf_counter()
        self.llm.reset_prefix_cache()
        self.last_update_timings["cache_reset_s"] = time.perf_counter() - t0
        self.llm.llm_engine.set_weight_version(str(self._version))

    def update_phases(self, stats: Any) -> None:
        """Colocated: copy the latest update's vLLM-side seconds (post-load processing,
        prefix-cache reset) into a ``bridge.accounting.SyncStats`` for its breakdown."""
        stats.post_s = self.receiver.timings.get("post_s", 0.0)
        stats.cache_reset_s = self.last_update_timings.get("cache_reset_s", 0.0)

    def reload_from_hf(self, path: str | Path | None = None) -> int:
        """Reload weights from an HF checkpoint through vLLM's own loader (TP narrowing and
        all) on every rank, via the same reload path. Used to read back what an HF load puts
        on each rank (``export_shards``) and as a reference in tests."""
        target = str(path or self.model_path)
        self.llm.collective_rpc("mgrpo_reload_from_hf", args=(target,))
        self._after_update()
        return self._version

    def update_weights_remote(self, update_info: list[dict[str, Any]]) -> None:
        """Disaggregated: run one update round on the workers (start, update with the
        per-worker ``update_info`` list indexed by worker rank, finish). The caller sends the
        buckets concurrently from its own ranks (the workers block in ``recv``)."""
        self.llm.collective_rpc("start_weight_update")
        self.llm.collective_rpc("update_weights", args=(update_info,))
        self.llm.collective_rpc("finish_weight_update")
        self._after_update()

    def init_transfer(self, init_info: dict[str, Any]) -> None:
        """Disaggregated: join the trainer<->worker process group on every worker
        (``megatron_grpo.bridge.vllm_plugin.TransferInitInfo`` fields)."""
        self.llm.collective_rpc("init_weight_transfer_engine", args=(init_info,))

    def worker_versions(self) -> list[int]:
        """Every worker's receiver version (all equal after a successful update)."""
        return list(self.llm.collective_rpc("mgrpo_version"))

    def checksums(self) -> list[dict[str, Any]]:
        """Per worker rank: ``{vLLM name: (shape, dtype, checksum)}`` of the logical weights the
        model holds (see ``ShardReceiver.checksums``)."""
        return list(self.llm.collective_rpc("mgrpo_checksums"))

    def export_shards(self) -> list[dict[str, torch.Tensor]]:
        """Per worker rank: the logical per-rank shards in vLLM layout (needs
        ``keep_weight_copies=True`` on CPU; see ``ShardReceiver.export``)."""
        # Raw bytes on the wire: vLLM's RPC result encoding turns tensors into nested lists
        # or memoryview-backed buffers, which lose dtype or cannot be pickled.
        return [
            {
                k: torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                .view(getattr(torch, dtype))
                .reshape(shape)
                for k, (shape, dtype, raw) in shards.items()
            }
            for shards in self.llm.collective_rpc("mgrpo_export")
        ]

    def shutdown(self) -> None:
        """Release the engine (and its processes when disaggregated)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        shm = own_cpu_shm_segment() if self.is_colocated else None
        if self.is_colocated:
            shutdown_in_process(llm)
        else:
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        if shm is not None:
            shm.unlink(missing_ok=True)
