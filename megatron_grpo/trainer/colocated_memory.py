"""The colocated memory dance: one GPU shared by the trainer and its vLLM rank, in turns.

Design: docs/rollout.md, "The phases (trainer/colocated_memory.py)".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from megatron_grpo.config import Config
from megatron_grpo.policy import Policy
from megatron_grpo.policy.offload import TrainerOffload

GIB = float(1 << 30)


def gpu_memory() -> dict[str, float] | None:
    """GiB allocated and reserved by torch's caching allocator now, and the peak allocated
    since the last call (the peak counter is reset); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    out = {
        "allocated_gib": torch.cuda.memory_allocated() / GIB,
        "reserved_gib": torch.cuda.memory_reserved() / GIB,
        "peak_gib": torch.cuda.max_memory_allocated() / GIB,
    }
    torch.cuda.reset_peak_memory_stats()
    return out


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class SleepingEngine(Protocol):
    """A colocated vLLM engine's sleep mode (``rollout.engine.RolloutEngine``)."""

    def sleep(self, level: int) -> None: ...

    def wake_up(self, tags: list[str] | None = None) -> None: ...


class ColocatedMemory:
    """Who holds the GPU when: see the module docstring. Build with ``from_config``.

    ``engine``: the colocated engine (None when inactive); ``state`` / ``weights``: the
    offloads of the optimizer state and of the weights, or None to keep them resident;
    ``sleep_level``: 0 = vLLM never sleeps.
    """

    def __init__(
        self,
        engine: SleepingEngine | None,
        state: TrainerOffload | None = None,
        weights: TrainerOffload | None = None,
        *,
        sleep_level: int = 1,
        empty_cache: Callable[[], None] = _empty_cache,
        memory: Callable[[], dict[str, float] | None] = gpu_memory,
    ) -> None:
        self.engine, self.state, self.weights = engine, state, weights
        self.sleep_level = sleep_level
        self._empty_cache, self._memory = empty_cache, memory
        self.vllm_weights_awake = self.vllm_kv_awake = True  # a new engine is awake
        self.boundaries: dict[str, dict[str, float]] = {}

    @classmethod
    def from_config(
        cls, cfg: Config, engine: SleepingEngine | None, policy: Policy, device: torch.device
    ) -> ColocatedMemory:
        """The dance ``cfg`` asks for; inactive (no calls at all) on CPU or disaggregated."""
        r = cfg.rollout
        if device.type != "cuda" or r.placement != "colocated":
            return cls(None, sleep_level=0)
        state = TrainerOffload(policy) if r.trainer_offload != "none" else None
        weights = (
            TrainerOffload(policy, optimizer=False, params=True)
            if r.trainer_offload == "all"
            else None
        )
        level = r.sleep_level if r.sleep_between_rollouts else 0
        return cls(engine, state, weights, sleep_level=level)

    @property
    def active(self) -> bool:
        return bool(self.sleep_level or self.state or self.weights)

    def mark(self, boundary: str) -> None:
        snap = self._memory()
        if snap is not None:
            self.boundaries[boundary] = snap

    def take_boundaries(self) -> dict[str, dict[str, float]] | None:
        """This step's snapshots (None on CPU), and a fresh record for the next step."""
        out, self.boundaries = self.boundaries, {}
        return out or None

    def _engine(self) -> SleepingEngine:
        """The engine that sleeps (there is one whenever ``sleep_level`` is set: from_config)."""
        assert self.engine is not None, "vLLM sleep mode without an engine"
        return self.engine

    # ------------------------------------------------------------------ the dance
    def before_generate(self) -> None:
        if self.active:
            if self.state is not None:
                self.state.offload()  # step 1 / after resume: the state is still resident
            if self.weights is not None:
                self.weights.offload()
            self._empty_cache()
            if self.sleep_level:
                if not self.vllm_weights_awake:
                    self._engine().wake_up(tags=["weights"])
                    self.vllm_weights_awake = True
                if not self.vllm_kv_awake:
                    self._engine().wake_up(tags=["kv_cache"])
                    self.vllm_kv_awake = True
        self.mark("rollout_start")

    def after_generate(self) -> None:
        self.mark("rollout_end")
        if self.active:
            if self.sleep_level:
                self._engine().sleep(level=self.sleep_level)
                self.vllm_weights_awake = self.vllm_kv_awake = False
            self._empty_cache()
            if self.weights is not None:
                self.weights.reload()
            if self.state is not None:
                self.state.reload()
        self.mark("train_start")

    def before_sync(self) -> None:
        self.mark("train_end")
        if self.active:
            if self.state is not None:
                self.state.offload()
            self._empty_cache()
            if self.sleep_level and not self.vllm_weights_awake:
                self._engine().wake_up(tags=["weights"])
                self.vllm_weights_awake = True
        self.mark("sync_start")

    @contextmanager
    def trainer_resident(self) -> Iterator[None]:
        """The trainer's whole state on the GPU inside the block (a checkpoint save reads it),
        back to where it was after."""
        moved = [o for o in (self.weights, self.state) if o is not None and o.offloaded]
        for o in moved:
            o.reload()
        try:
            yield
        finally:
            for o in reversed(moved):
                o.offload()
