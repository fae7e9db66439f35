"""The resharding bridge: trainer TP/PP shards -> each vLLM rank's own shards (docs/bridge.md).

- :mod:`.plan`: which slices go where (``SyncPlan``, computed once from the layouts);
- :mod:`.transport`: executes a plan with flat buckets, point to point (``Transport``), on
  :mod:`.schedule` (which operations each rank runs, in what order), :mod:`.p2p` (the
  point-to-point engine and the plan handshake) and :mod:`.buckets` (batched bucket copies);
- :mod:`.accounting`: bytes and seconds of a sync (``SyncStats``, ``SyncReport``);
- :mod:`.baseline`: the anchors' gather-and-broadcast path, measured the same way;
- :mod:`.checksum` / :mod:`.verify`: exact checksums, and the checks of a sync (with
  logprob parity);
- :mod:`.receiver` / :mod:`.sessions` / :mod:`.vllm_plugin`: the vLLM side;
- :mod:`.transfer_group`: what both ends of a disaggregated sync share (``PlanInputs``, the
  transfer group);
- :mod:`.weight_sync`: the trainer's handle (``WeightSender``, colocated or disaggregated).

Names are resolved lazily so that ``import megatron_grpo.bridge`` stays light (the GPU-free
``plan`` command imports the plan only).
"""

from __future__ import annotations

_EXPORTS = {
    "Transport": "transport",
    "SyncError": "schedule",
    "PlanMismatchError": "p2p",
    "build_schedule": "schedule",
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
