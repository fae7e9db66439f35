"""When the loop pushes the trainer's weights to vLLM: ``sync.mode`` fixed or adaptive.

``fixed`` is Algorithm 1 (Mroueh et al., arXiv 2505.22257): a sync after step k when
``k % v == 0``. ``adaptive`` (issue 25) syncs after step k when k - policy_version reached
``sync.min_interval`` and the step's drift exceeds ``sync.max_drift``, or when it reached
``sync.max_interval`` (``algorithms.drift.adaptive_sync_due``). The drift a decision reads
is the value every rank agreed on (``trainer.logprobs.measure_drift``), so every
rank decides the same; the schedule's only state is ``policy_version``, the step of the last
sync (the one place the loop keeps it), which a resume restores, so a resumed run decides as
an uninterrupted one does.

``window_end(step)`` is the last step certain to be sampled from the weights served now:
what ``rollout.ahead`` may generate before the trainer gets there (rollout/ahead.py). Fixed:
the next multiple of v. Adaptive: no sync can come before policy_version + min_interval, so the
window reaches that far, and past it every step is its own window (its batch is generated
after the step before decided whether to sync).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_grpo.algorithms.drift import adaptive_sync_due
from megatron_grpo.config.schema import SyncConfig


@dataclass
class SyncSchedule:
    mode: str
    sync_interval: int
    """``sync.interval``, v: fixed mode syncs after every v-th step."""
    max_drift: float
    min_interval: int
    max_interval: int
    policy_version: int = 0
    """The step whose weights vLLM serves now: the step after which they were pushed (0: the
    starting weights). A batch of step k was sampled from it; its lag is k - 1 - it."""

    @classmethod
    def from_config(cls, cfg: SyncConfig, policy_version: int = 0) -> SyncSchedule:
        return cls(cfg.mode, cfg.interval, cfg.max_drift, cfg.min_interval, cfg.max_interval,
                   policy_version)  # fmt: skip

    @property
    def adaptive(self) -> bool:
        return self.mode == "adaptive"

    def due(self, step: int, drift: float | None) -> bool:
        """Sync after step ``step``? ``drift``: the step's agreed drift (adaptive needs it)."""
        if not self.adaptive:
            return step % self.sync_interval == 0
        if drift is None:
            raise ValueError(f"sync.mode=adaptive: step {step} has no measured drift to decide by.")
        since = step - self.policy_version
        return adaptive_sync_due(drift, since, self.max_drift, self.min_interval, self.max_interval)

    def synced(self, step: int) -> None:
        self.policy_version = step

    def window_end(self, step: int) -> int:
        """The last step (>= ``step``) certain to be sampled from the weights served now."""
        if not self.adaptive:
            return -(-step // self.sync_interval) * self.sync_interval
        return max(step, self.policy_version + self.min_interval)
