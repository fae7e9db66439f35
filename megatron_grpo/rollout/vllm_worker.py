"""The worker extension every ``RolloutEngine`` gives vLLM (``LLM(worker_extension_cls=...)``):
the receiver's string RPCs (bridge/vllm_plugin.py) and routing replay's capture
(rollout/routing_capture.py), kept apart so that importing the capture stays light."""

from __future__ import annotations

from typing import Any

from megatron_grpo.bridge.vllm_plugin import ReceiverWorkerExtension
from megatron_grpo.rollout.routing_capture import RoutingCapture


class RolloutWorkerExtension(ReceiverWorkerExtension):
    """The receiver's worker RPCs (bridge/vllm_plugin.py) plus the routing capture's."""

    model_runner: Any  # the vLLM worker's, which this class is mixed into

    def mgrpo_capture_routing(self) -> int:
        """Start capturing routed experts; returns the number of MoE layers."""
        if getattr(self, "_mgrpo_routing", None) is None:
            self._mgrpo_routing = RoutingCapture(self.model_runner)
        return self._mgrpo_routing.num_layers

    def mgrpo_take_routing(self) -> dict[str, tuple[list[int], str, bytes]]:
        """The captured requests' rows as (shape, dtype, raw bytes) by internal request id."""
        return {
            k: (list(a.shape), str(a.dtype), a.tobytes())
            for k, a in self._mgrpo_routing.take().items()
        }
