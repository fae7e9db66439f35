"""``grpo_config(**keys)``: a ``GRPOConfig`` from its keys named without their section
(``grpo_config(kl_coef=0.1, loss_agg="constant")``), each placed in the section that owns
it, so a unit test of the loss math names the knobs it turns and nothing else."""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_grpo.config.schema import (
    BatchConfig,
    GRPOConfig,
    KLConfig,
    LossConfig,
    OffPolicyConfig,
)

SECTIONS = {"batch": BatchConfig, "loss": LossConfig, "kl": KLConfig,
            "off_policy": OffPolicyConfig}  # fmt: skip


def grpo_config(**keys: Any) -> GRPOConfig:
    parts: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    top: dict[str, Any] = {}
    for key, value in keys.items():
        owner = [
            n for n, cls in SECTIONS.items() if key in {f.name for f in dataclasses.fields(cls)}
        ]
        (parts[owner[0]] if owner else top)[key] = value
    return GRPOConfig(**top, **{n: cls(**parts[n]) for n, cls in SECTIONS.items()})
