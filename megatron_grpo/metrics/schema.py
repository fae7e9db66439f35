"""The per-step metrics record: one ``StepMetrics`` per trainer step, one JSON line each.

The table in ``docs/metrics.md`` documents every field; keep the two in step. Extra keys
(anything the trainer or an algorithm wants to log) are allowed and travel in ``extra``;
they are written flat next to the fixed fields.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# The step phases the trainer times; ``time_step`` is the whole step (>= their sum).
PHASES: tuple[str, ...] = ("rollout", "reward", "logprobs", "train", "sync")


@dataclass
class StepMetrics:
    """One trainer step. Times are wall-clock seconds; ``None`` means "not measured"."""

    step: int
    """Trainer step k (1-based: the step that just finished)."""
    reward_mean: float | None = None
    """Mean reward over the batch's prompts_per_step * G responses."""
    reward_std: float | None = None
    """Population std of the rewards over the batch."""
    pass_rate: float | None = None
    """Fraction of responses whose reward counts as correct (task reward > 0)."""
    synced: bool = False
    """True when the trainer pushed its weights to vLLM in this step (Algorithm 1: k % v == 0;
    sync.mode=adaptive: when the drift or sync.max_interval called for it)."""
    policy_version: int | None = None
    """Version of the weights vLLM served for this batch: the trainer step whose weights they
    are (0 = the initial weights)."""
    lag: int | None = None
    """Off-policy degree of this batch: step - policy_version (filled in when omitted)."""
    interval_since_sync: int | None = None
    """Steps trained on the served weights so far, this one included (step - policy_version);
    on a synced step, the length of the interval its sync closed."""
    drift: float | None = None
    """Drift of the trainer's policy pi_k (before this step's update) from the served alpha:
    token-mean k3 estimate of KL(alpha || pi_k) on the batch (algorithms/drift.py), the value
    sync.mode=adaptive decides by. Measured with sync.mode=adaptive or
    grpo.off_policy.ratio_mode=exact (None otherwise)."""
    sync_bytes: int = 0
    """Bytes of weights sent to vLLM in this step (0 when not synced)."""
    time_rollout: float | None = None
    """vLLM generation."""
    time_reward: float | None = None
    """Reward computation."""
    time_logprobs: float | None = None
    """Trainer forward passes for pi_k / pi_ref log-probs."""
    time_train: float | None = None
    """The i SGD iterations (forward, backward, optimizer)."""
    time_sync: float | None = None
    """Weight push to vLLM (0 or None when not synced)."""
    time_step: float | None = None
    """The whole step, phases plus everything between them."""
    response_len_mean: float | None = None
    """Mean response length in tokens (the model's own: a multi-turn episode's environment
    tokens are not counted)."""
    response_len_max: int | None = None
    """Longest response in tokens (the model's own)."""
    clip_frac_low: float | None = None
    """Fraction of response tokens clipped at the lower bound (ratio < r' - eps_low, A < 0)."""
    clip_frac_high: float | None = None
    """Fraction of response tokens clipped at the upper bound (ratio > r' + eps_high, A > 0)."""
    kl: float | None = None
    """Mean per-token KL(pi || pi_ref) estimate (grpo.kl.kl_estimator)."""
    entropy: float | None = None
    """Mean per-token entropy of pi."""
    masked_frac: float | None = None
    """Fraction of prompts masked out (zero reward variance, RED-Drop, overlong filter)."""
    tokens_per_s: float | None = None
    """(prompt + response) tokens processed by the trainer per second of time_step."""
    loss: float | None = None
    """Policy loss (mean over the SGD iterations)."""
    grad_norm: float | None = None
    """Gradient norm before clipping (last optimizer step)."""
    lr: float | None = None
    """Learning rate used in this step."""
    skipped_nan: bool = False
    """True when the step was skipped because the loss or the grad norm was not finite."""
    gpu_memory: dict[str, dict[str, float]] | None = None
    """GPU memory at each phase boundary of the step (trainer/colocated_memory.py): boundary name ->
    ``allocated_gib``, ``reserved_gib`` and ``peak_gib`` (peak allocated since the previous
    boundary). Boundaries: rollout_start, rollout_end, train_start, train_end, sync_start.
    None (null) on CPU."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Any other scalars; written flat next to the fields above (names must not collide)."""

    def __post_init__(self) -> None:
        if self.lag is None and self.policy_version is not None:
            self.lag = self.step - self.policy_version
        clash = sorted(set(self.extra) & FIELD_NAMES)
        if clash:
            raise ValueError(
                f"StepMetrics.extra keys {clash} collide with fixed fields: "
                "pass them as fields, or rename them."
            )

    def to_row(self) -> dict[str, Any]:
        """The flat JSON-able dict written as one line of metrics.jsonl."""
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        row.update(self.extra)
        return {k: to_scalar(v) for k, v in row.items()}

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> StepMetrics:
        """Build from a flat dict; keys that are not fields go to ``extra``."""
        if "step" not in values:
            raise ValueError(f"metrics have no 'step' key (keys: {sorted(values)}): add the step.")
        known = {k: v for k, v in values.items() if k in FIELD_NAMES}
        extra = {k: v for k, v in values.items() if k not in FIELD_NAMES}
        extra.update(known.pop("extra", None) or {})
        return cls(**known, extra=extra)


FIELD_NAMES: frozenset[str] = frozenset(
    f.name for f in dataclasses.fields(StepMetrics) if f.name != "extra"
)


def to_scalar(value: Any) -> Any:
    """A JSON-safe scalar: tensors/numpy scalars become Python numbers, NaN/inf become None.

    metrics.jsonl is strict JSON (``json.loads`` of any line works in every language), so a
    non-finite float is written as ``null``; ``skipped_nan`` records why a step has no loss.
    """
    if hasattr(value, "item") and callable(value.item):  # torch / numpy scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [to_scalar(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): to_scalar(v) for k, v in value.items()}
    raise TypeError(
        f"metric value {value!r} of type {type(value).__name__} is not a scalar: "
        "log numbers, bools, strings (or lists/dicts of them)."
    )
