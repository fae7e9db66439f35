"""vLLM plugin: the ``megatron_grpo`` weight-transfer backend and the worker extension.

Design: docs/bridge.md, "The vLLM plugin (bridge/vllm_plugin.py)".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from megatron_grpo.bridge.receiver import ShardReceiver
from megatron_grpo.bridge.transfer_group import init_transfer_group, worker_transport

BACKEND_NAME = "megatron_grpo"


def register() -> None:
    """Entry point: register the worker-side backend (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND_NAME, "megatron_grpo.bridge.vllm_plugin", "MegatronShardTransferEngine"
        )


@dataclass
class TransferInitInfo:
    """What ``init_weight_transfer_engine`` gives each worker: the transfer group to join and
    the plan to receive by."""

    master_address: str = "127.0.0.1"
    master_port: int = 0
    """Where trainer rank 0 hosts the transfer group's store (``init_transfer_group``)."""
    world_size: int = 0
    """Trainer ranks + vLLM workers in the transfer group."""
    rank_offset: int = 0
    """Group rank of vLLM worker 0 (trainer ranks come first)."""
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: float = 600.0
    keep_copies: bool | None = None
    """Keep a copy of every logical shard (for ``mgrpo_export``); None leaves it as is."""
    plan: dict[str, Any] | None = None
    """``bridge.transfer_group.PlanInputs`` as a dict: the worker rebuilds the trainer's sync
    plan from it and receives through the same ``Transport`` (``TransferUpdateInfo.plan``)."""


@dataclass
class TransferUpdateInfo:
    plan: bool = False
    """Receive this worker's shards by running the receiving half of the plan's
    ``Transport`` (set up by ``TransferInitInfo.plan``); the only way a worker receives."""


def _engine_base() -> type:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return WeightTransferEngine


class MegatronShardTransferEngine(_engine_base()):  # type: ignore[misc]
    """Worker-side backend: per-rank shards in, through ``ShardReceiver``."""

    init_info_cls = TransferInitInfo
    update_info_cls = TransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(
        self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver = ShardReceiver(model, vllm_config.model_config)
        self.group: torch.distributed.ProcessGroup | None = None
        self.transport: Any = None

    def worker_group_rank(self, rank_offset: int) -> int:
        pc = self.parallel_config
        return rank_offset + pc.data_parallel_index * pc.world_size + pc.rank

    def init_transfer_engine(self, init_info: TransferInitInfo) -> None:
        if init_info.keep_copies is not None:
            self.receiver.keep_copies = init_info.keep_copies
        if init_info.world_size <= 0:
            return  # in-process only: no transport group
        self.group = init_transfer_group(
            init_info.master_address,
            init_info.master_port,
            self.worker_group_rank(init_info.rank_offset),
            init_info.world_size,
            init_info.backend,
            init_info.timeout_s,
        )
        if init_info.plan is not None:
            rank = self.worker_group_rank(init_info.rank_offset)
            self.transport = worker_transport(init_info.plan, rank, self.group, self.device)

    def start_weight_update(self) -> None:
        self.receiver.start()

    def receive_weights(self, update_info: TransferUpdateInfo) -> None:
        if not update_info.plan:
            raise RuntimeError(
                "update_weights without plan=True: a worker receives only through the plan's "
                "transport (TransferUpdateInfo(plan=True), as rollout.server sends it)."
            )
        if self.transport is None:
            raise RuntimeError(
                "update_weights(plan=True) but this worker has no plan transport: call "
                "init_weight_transfer_engine with a TransferInitInfo (world_size > 0) whose "
                "plan is bridge.transfer_group.PlanInputs first."
            )
        # The receiving half of the trainer's sync: every shard of this rank, handed to
        # the receiver as soon as it is complete (inside vLLM's reload session).
        self.transport.run_plan({}, deliver=self.receiver.receive_shard)

    def finish_weight_update(self) -> None:
        self.receiver.finish()

    def shutdown(self) -> None:
        self.group = None
        self.transport = None


class ReceiverWorkerExtension:
    """Methods mixed into vLLM's worker class; called as ``llm.collective_rpc("mgrpo_...")``."""

    def _mgrpo_receiver(self) -> Any:
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "receiver"):
            raise RuntimeError(
                "no megatron_grpo weight-transfer engine on this worker: create the LLM with "
                "weight_transfer_config=WeightTransferConfig(backend='megatron_grpo')."
            )
        return engine.receiver

    def mgrpo_version(self) -> int:
        return self._mgrpo_receiver().version

    def mgrpo_set_keep_copies(self, keep: bool) -> None:
        self._mgrpo_receiver().keep_copies = keep

    def mgrpo_expected_shards(self) -> dict[str, tuple[list[int], str]]:
        return {
            n: (list(s), str(d).removeprefix("torch."))
            for n, (s, d) in self._mgrpo_receiver().expected_shards().items()
        }

    def mgrpo_checksums(self) -> dict[str, tuple[list[int], str, int]]:
        return {
            n: (list(c.shape), c.dtype, c.value)
            for n, c in self._mgrpo_receiver().checksums().items()
        }

    def mgrpo_export(self) -> dict[str, tuple[list[int], str, bytes]]:
        """``{name: (shape, dtype, raw bytes)}``: bytes survive vLLM's RPC result encoding."""
        return {
            n: (
                list(t.shape),
                str(t.dtype).removeprefix("torch."),
                t.view(-1).view(torch.uint8).numpy().tobytes(),
            )
            for n, t in self._mgrpo_receiver().export().items()
        }

    def mgrpo_reload_from_hf(self, path: str) -> int:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            version = self._mgrpo_receiver().load_hf_checkpoint(path)
        reset = getattr(self.model_runner, "reset_lora_state", None)  # type: ignore[attr-defined]
        if reset is not None:
            reset()
        return version
