"""The learning-rate schedule: linear warmup, then constant or cosine decay.

It owns its step count and its state: ``step()`` advances it when the optimizer has stepped
and writes the next rate into the optimizer's param groups; ``state_dict`` /
``load_state_dict`` round-trip both the step count and the schedule's length.
"""

from __future__ import annotations

import math
from typing import Any

from megatron_grpo.config.schema import ConfigError, OptimConfig


class LRSchedule:
    """Linear warmup over ``warmup_steps``, then constant or cosine decay to ``min_lr``.

    ``lr_at(k)`` is the rate used by optimizer step k (0-based): ``lr*(k+1)/warmup`` during
    warmup (so step 0 already moves), then ``lr`` (constant) or
    ``min_lr + (lr-min_lr)*(1+cos(pi*progress))/2`` with progress over ``total_steps``.

    With an ``optimizer`` the schedule drives its param groups' ``lr``: the rate of the
    current step is set when it is built, after every ``step()`` and after a load.
    """

    def __init__(self, optim: OptimConfig, total_steps: int, optimizer: Any = None) -> None:
        self.lr, self.min_lr = optim.lr, optim.min_lr
        self.warmup, self.style = optim.warmup_steps, optim.lr_schedule
        self.total_steps = max(total_steps, 1)
        self.step_count = 0
        self.optimizer = optimizer
        self._apply()

    def lr_at(self, k: int) -> float:
        if self.warmup and k < self.warmup:
            return self.lr * (k + 1) / self.warmup
        if self.style == "constant":
            return self.lr
        span = max(self.total_steps - self.warmup, 1)
        progress = min(max((k - self.warmup) / span, 0.0), 1.0)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))

    @property
    def current_lr(self) -> float:
        """The rate the next optimizer step uses."""
        return self.lr_at(self.step_count)

    def step(self) -> None:
        """The optimizer has applied a step: move to the next one's rate."""
        self.step_count += 1
        self._apply()

    def _apply(self) -> None:
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = self.current_lr

    def state_dict(self) -> dict[str, int]:
        return {"step_count": self.step_count, "total_steps": self.total_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue the saved schedule. Its length must be this run's when it shapes the
        rates (cosine): a resumed run whose ``steps`` (or batch shape) changed would
        otherwise decay on a different curve than the one it started. A constant schedule's
        length enters no rate, so a run may be extended under it."""
        saved = int(state["total_steps"])
        if saved != self.total_steps and self.style == "cosine":
            raise ConfigError(
                f"the checkpoint's cosine LR schedule spans total_steps={saved} optimizer "
                f"steps but this run's config gives {self.total_steps}: resume with the "
                "steps, grpo.batch.sgd_iterations and batch sizes it was saved with (or start a "
                "new run to change the schedule's length)."
            )
        self.step_count = int(state["step_count"])
        self._apply()
