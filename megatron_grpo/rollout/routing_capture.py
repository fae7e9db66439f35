"""vLLM's routed experts on the V1 model runner (CPU), captured in the worker: routing replay.

vLLM 0.32 returns routed experts itself (``enable_return_routed_experts``,
``CompletionOutput.routed_experts`` [tokens, layers, top-k]) only through its AuxOutput
connector, which needs Model Runner V2 (vllm/config/vllm.py
``_verify_aux_output_compatibility``), and V2 needs Triton, which the CPU build lacks. So the
worker extension binds a capture callback to every MoE layer's router
(``BaseRouter.set_capture_fn``: the logical top-k ids, before any EPLB mapping,
vllm/model_executor/layers/fused_moe/router/base_router.py) and wraps the model runner's
``execute_model`` to learn which request each forwarded token belongs to: tokens of a step
are laid out request by request in ``input_batch.req_ids`` order, request r contributing
``num_scheduled_tokens[r]`` tokens from position ``num_computed_tokens[r]``. A request's rows
are vLLM's format: one per forwarded token (prompt and response, the last sampled token
excluded), ``[prompt + response - 1, layers, top-k]``. Prefix caching is off while capturing
(a cached prompt block is not forwarded again, so its routing would be missing).
"""

from __future__ import annotations

from typing import Any

import numpy as np


class RoutingCapture:
    """The routed experts of every request this worker forwarded since the last ``take``."""

    def __init__(self, runner: Any) -> None:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1ModelRunner

        if not isinstance(runner, V1ModelRunner):
            raise ValueError(
                f"rollout.routing_replay: vLLM runs {type(runner).__name__}, not the V1 model "
                "runner the capture reads its batch from: set VLLM_USE_V2_MODEL_RUNNER=0."
            )
        self.runner = runner
        self.rows: dict[str, list[tuple[int, np.ndarray]]] = {}
        self._step: dict[int, np.ndarray] = {}
        layers = [m for m in runner.model.modules() if isinstance(m, MoERunner)]
        unsupported = [
            type(m.router).__name__ for m in layers if not isinstance(m.router, BaseRouter)
        ]
        if not layers or unsupported:
            raise ValueError(
                f"rollout.routing_replay: vLLM's model has {len(layers)} MoE layers "
                f"(routers {unsupported or 'none'} cannot be captured): set "
                "rollout.routing_replay=off."
            )
        self.num_layers = max(m.layer_id for m in layers) + 1
        for m in layers:
            m.router.set_capture_fn(lambda ids, layer=m.layer_id: self._capture(layer, ids))
        inner = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            self._step.clear()
            out = inner(scheduler_output, *args, **kwargs)
            if self._step:
                self._file(scheduler_output.num_scheduled_tokens)
            return out

        runner.execute_model = execute_model

    def _capture(self, layer: int, topk_ids: Any) -> None:
        self._step[layer] = topk_ids.to("cpu", copy=True).numpy()

    def _file(self, scheduled: dict[str, int]) -> None:
        """File this step's rows under their requests (the batch's order, before the
        runner's next ``_update_states`` reorders it)."""
        batch = self.runner.input_batch
        total = sum(scheduled[r] for r in batch.req_ids if r in scheduled)
        if len(self._step) != self.num_layers:
            raise RuntimeError(
                f"routing capture: {len(self._step)} of {self.num_layers} "
                "MoE layers reported this step's experts"
            )
        step = np.stack([self._step[i][:total] for i in range(self.num_layers)], axis=1)
        at = 0
        for req in batch.req_ids:
            n = scheduled.get(req, 0)
            if n:
                start = int(batch.num_computed_tokens_cpu[batch.req_id_to_index[req]])
                self.rows.setdefault(req, []).append((start, step[at : at + n]))
                at += n

    def take(self) -> dict[str, np.ndarray]:
        """Each request's rows by vLLM's internal request id, in position order (uint8
        where the expert ids fit), and forget them. A request vLLM preempted and forwarded
        again keeps its latest rows (what its later tokens attended to)."""
        out = {}
        for req, parts in self.rows.items():
            end = max(start + len(rows) for start, rows in parts)
            arr = np.zeros((end, *parts[0][1].shape[1:]), dtype=parts[0][1].dtype)
            seen = np.zeros(end, dtype=bool)
            for start, rows in parts:  # in capture order: a recompute overwrites
                arr[start : start + len(rows)] = rows
                seen[start : start + len(rows)] = True
            if not seen.all():
                raise RuntimeError(
                    f"routing capture of request {req}: position {int(np.argmin(seen))} was "
                    "never forwarded (a prefix-cache hit?)"
                )
            out[req] = arr.astype(np.uint8 if arr.max(initial=0) < 256 else np.int16)
        self.rows.clear()
        return out


def sample_key(internal_id: str) -> tuple[str, int]:
    """(the request id ``LLM.generate`` gave, sample index) of a vLLM internal request id:
    ``<external>-<8 hex>`` (vllm/v1/engine/input_processor.py ``assign_request_id``), and
    for ``n > 1`` its children ``<index>_<parent internal id>`` (parallel_sampling.py)."""
    index, _, parent = internal_id.partition("_")
    if not parent:
        index, parent = "0", internal_id
    return parent.rsplit("-", 1)[0], int(index)


def take_routed(llm: Any) -> dict[tuple[str, int], np.ndarray]:
    """The routed experts of the requests ``llm`` generated since the last take, by
    (request id, sample index), from worker rank 0 (every TP rank routes alike)."""
    taken = llm.collective_rpc("mgrpo_take_routing")[0]
    return {
        sample_key(k): np.frombuffer(raw, dtype=dtype).reshape(shape)
        for k, (shape, dtype, raw) in taken.items()
    }


def routed_rows(routed: dict, request_id: str, index: int, forwarded: int) -> np.ndarray:
    """Sample ``index`` of request ``request_id``'s experts, checked to hold one row per
    ``forwarded`` token (prompt + response - 1)."""
    rows = routed.get((request_id, index))
    if rows is None or rows.shape[0] != forwarded:
        got = None if rows is None else rows.shape[0]
        raise RuntimeError(
            f"routing capture: request {request_id} sample {index} has {got} rows of routed "
            f"experts, expected {forwarded} (prompt + response - 1)."
        )
    return rows
