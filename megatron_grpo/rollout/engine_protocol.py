"""``Engine``: what the rollout, the agent loop and the bridge ask of an inference engine.

``rollout.engine.RolloutEngine`` implements it over vLLM, and it is the one place that
touches vLLM's internals (its ``LLM``, worker, executor and ``SamplingParams``:
``rollout/engine.py``, ``rollout/samples.py``, ``rollout/vllm_setup.py``,
``rollout/vllm_worker.py``, ``rollout/routing_capture.py``; the weight-transfer plugin vLLM
loads, ``bridge/vllm_plugin.py``, runs inside vLLM's workers). The GPU suite's stand-in
(tests/gpu/hf_engine.py ``HFEngine``) implements the colocated half with transformers.
What a second engine (SGLang) would implement: docs/architecture.md, "The engine seam".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from megatron_grpo.rollout.samples import Sample


class Engine(Protocol):
    """One rollout engine replica (its TP ranks behind it)."""

    tp: int
    seed: int
    replica_index: int
    """Offsets every request's seed (``algorithms.seeds.replica_offset``)."""

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
        """``n`` samples per prompt, prompt-major, each with its tokens and the sampled
        tokens' log-probs under ``softmax(logits / temperature)``; request i seeded
        ``seeds[i]`` (else ``seed + i*n``), its samples ``+0..n-1``; a completion ends at a
        stop token, at a stop string (kept in its tokens) or at its token limit
        (``max_tokens_each[i]``, else ``max_new_tokens``)."""
        ...

    def sleep(self, level: int = 1) -> None:
        """Free the device memory the engine holds while the trainer trains (colocated)."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back what ``sleep`` freed (``["weights"]`` first, then ``["kv_cache"]``)."""
        ...

    @property
    def weight_version(self) -> int:
        """Completed weight updates (0: the weights it started with)."""
        ...

    # The bridge's hooks. Colocated: shards in vLLM's layout (layouts/vllm.py) arrive in
    # process; disaggregated: the engine's workers run the receiving half of the plan.
    def begin_weight_update(self, record_checksums: bool = True) -> Any:
        """Colocated: open an update and return the receiver (``receive_shard(name, t)``)."""
        ...

    def finish_weight_update(self) -> float:
        """Colocated: close the update (post-load processing, cache reset); seconds taken."""
        ...

    def update_phases(self, stats: Any) -> None:
        """Copy the last update's engine-side seconds into a ``bridge.accounting.SyncStats``."""
        ...

    def begin_hf_update(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Colocated, baseline sync: load full HF-named tensors (the engine shards them)."""
        ...

    def finish_hf_update(self) -> None: ...

    def init_transfer(self, init_info: dict[str, Any]) -> None:
        """Disaggregated: the engine's workers join the trainer's transfer group."""
        ...

    def update_weights_remote(self, update_info: list[dict[str, Any]]) -> None:
        """Disaggregated: one update round on the workers, fed by the trainer's ranks."""
        ...

    def shutdown(self) -> None: ...
