"""The resharding bridge: trainer TP/PP shards -> each vLLM rank's own shards (docs/bridge.md).

- :mod:`.plan`: which slices go where (``SyncPlan``, computed once from the layouts);
- :mod:`.transport`: executes a plan with flat buckets, point to point (``Transport``);
- :mod:`.accounting`: bytes and seconds of a sync (``SyncStats``, ``SyncReport``);
- :mod:`.baseline`: the anchors' gather-and-broadcast path, measured the same way;
- :mod:`.checksum` / :mod:`.verify`: exact checksums, and the checks of a sync (with
  logprob parity);
- :mod:`.receiver` / :mod:`.vllm_plugin`: the vLLM side;
- :mod:`.weight_sync`: the trainer's handle (``WeightSender``, colocated or disaggregated).

Names are resolved lazily so that ``import megatron_grpo.bridge`` stays light (the GPU-free
``plan`` command imports the plan only).
"""

from __future__ import annotations

_EXPORTS = {
    "Transport": "transport",
    "SyncError": "transport",
    "PlanMismatchError": "transport",
    "apply_plan_locally": "transport",
    "build_schedule": "transport",
    "SyncStats": "accounting",
    "SyncReport": "accounting",
    "BaselineSync": "baseline",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
