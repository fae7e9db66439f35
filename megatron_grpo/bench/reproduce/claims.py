"""``bench reproduce``'s claims (the command: ``bench/reproduce/run.py``; docs/reproduction.md):
each names the variants of the training job it compares, the comparisons and a reward
threshold; ``plan_runs`` collapses the variants the claims share into one run each."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Variant:
    name: str
    """Label in plots and tables."""
    v: int
    """Sync period (sync.interval)."""
    overrides: tuple[str, ...] = ()
    """key=value on top of the claim's task settings."""
    match: str | None = None
    """Another variant of the claim (listed before this one): this variant's v is, per seed,
    ``matched_sync_interval`` of that run's syncs (``v`` is then only a placeholder)."""


@dataclass(frozen=True)
class Comparison:
    kind: Literal["better", "equivalent"]
    a: str
    """Variant name whose metric is claimed better than / equal to b's."""
    b: str
    metric: Literal["final", "auc"] = "final"
    """``final``: mean reward of the last ``window`` steps; ``auc``: mean reward over all
    steps (higher = learned earlier)."""


@dataclass(frozen=True)
class Claim:
    id: int
    title: str
    source: str
    task: tuple[str, ...]
    """key=value shared by all variants of the claim (the task and its setting)."""
    variants: tuple[Variant, ...]
    comparisons: tuple[Comparison, ...]
    threshold: float
    """Reward the trailing window-mean must reach for "steps to threshold"."""


# The tiny default job (megatron_grpo/config/schema.py): synthetic:max after a 15-step warm
# start, G=8 x 8 prompts, lr 1e-3: it learns from ~0.35 to ~0.75 mean reward in 60 steps.
TASK_MAX: tuple[str, ...] = ()
# Claim 2 needs the failure mode the mask addresses: most groups with zero reward variance.
# A 5-step warm start leaves the model answering right ~3% of the time (about half the
# groups all-wrong); beta=0.1 is the paper's GSM8K KL weight, and on-policy (v=1) is where
# the paper reports the unstable run. See docs/reproduction.md, "Claim 2".
TASK_SPARSE: tuple[str, ...] = ("model.warm_start_steps=5", "grpo.kl.kl_coef=0.1")
# Claim 3 through existing keys: REC's one-side clip mask reads grpo.loss.clip_eps_low/high (the
# defaults are PPO's 0.2/0.2); rec_weight none = NoIS, is = the importance weight rho.
REC = ("grpo.loss.policy_loss=rec", "grpo.loss.rec_clip=one_side")
WIDE = ("grpo.loss.clip_eps_low=0.6", "grpo.loss.clip_eps_high=2.0")
# Claim 5: ratio_mode=exact gives every variant pi_k's log-probs, so fixed runs log the same
# drift column as adaptive ones at no extra forward pass (equal cost per step). On the tiny
# job the per-token drift after 1-3 updates spans ~1e-3..1e-1 (docs/reproduction.md, claim
# 5); max_drift=0.02 lands between, so the interval follows the drift within 1..8.
TASK_DRIFT: tuple[str, ...] = ("grpo.off_policy.ratio_mode=exact",)
ADAPTIVE = ("sync.mode=adaptive", "sync.max_drift=0.02", "sync.min_interval=1",
            "sync.max_interval=8")  # fmt: skip
# Claim 6: the same adaptive rule read off the staleness part alone (grpo.off_policy.score_alpha:
# alpha scored by the trainer, so the drift leaves out vLLM's numerical mismatch with it).
STALENESS = ("grpo.off_policy.score_alpha=true",)

# Claim 7: dynamic sampling (grpo.dynamic_sampling) on the sparse task, where most groups carry
# no signal; its reward curve is ds_reward_mean (every generated response, not the kept
# groups). Both variants train prompts_per_step * G sequences a step, so a higher reward per
# step is the same reward in fewer trained tokens.
DYNAMIC = ("grpo.dynamic_sampling.enabled=true",)

CLAIMS: dict[int, Claim] = {
    c.id: c
    for c in (
        Claim(
            1,
            "Off-policy v > 1 matches on-policy v = 1 in reward per step",
            "Mroueh et al., arXiv 2505.22257, Sec. 5 (v=10 equals v=1 on GSM8K, AIME24, MATH500)",
            TASK_MAX,
            (Variant("v=1", 1), Variant("v=4", 4), Variant("v=8", 8)),
            (Comparison("equivalent", "v=4", "v=1"), Comparison("equivalent", "v=8", "v=1")),
            threshold=0.6,
        ),
        Claim(
            2,
            "The zero-variance mask stabilises training (sparse success)",
            "Mroueh et al., arXiv 2505.22257 (on-policy GSM8K: unstable 45% -> stable 50%)",
            TASK_SPARSE,
            (
                Variant("mask on", 1, ("grpo.zero_variance_mask=true",)),
                Variant("mask off", 1, ("grpo.zero_variance_mask=false",)),
            ),
            (Comparison("better", "mask on", "mask off"),),
            threshold=0.3,
        ),
        Claim(
            3,
            "Clipping, not importance sampling, carries stability; wide clip (0.6, 2.0) learns "
            "faster than (0.2, 0.2)",
            "Yao et al., arXiv 2509.24203 (REC-OneSide, off-policy)",
            TASK_MAX,
            (
                Variant("clip 0.2/0.2", 4, (*REC, "grpo.loss.rec_weight=none")),
                Variant("clip 0.6/2.0", 4, (*REC, *WIDE, "grpo.loss.rec_weight=none")),
                Variant("clip 0.2/0.2 + IS", 4, (*REC, "grpo.loss.rec_weight=is")),
                Variant("clip 0.6/2.0 + IS", 4, (*REC, *WIDE, "grpo.loss.rec_weight=is")),
            ),
            (
                Comparison("better", "clip 0.6/2.0", "clip 0.2/0.2", "auc"),
                Comparison("better", "clip 0.6/2.0 + IS", "clip 0.2/0.2 + IS", "auc"),
                Comparison("equivalent", "clip 0.6/2.0 + IS", "clip 0.6/2.0"),
                Comparison("equivalent", "clip 0.2/0.2 + IS", "clip 0.2/0.2"),
            ),
            threshold=0.6,
        ),
        Claim(
            4,
            "RED-Weight and RED-Drop help off-policy (v = 4)",
            "Yao et al., arXiv 2509.24203 (RED-Drop, RED-Weight)",
            TASK_MAX,
            (
                Variant("GRPO", 4),
                Variant("RED-Weight", 4, ("grpo.advantage=red_weight",)),
                Variant("RED-Drop", 4, ("grpo.red_drop=true",)),
            ),
            (Comparison("better", "RED-Weight", "GRPO"), Comparison("better", "RED-Drop", "GRPO")),
            threshold=0.6,
        ),
        Claim(
            5,
            "Adaptive sync (drift-triggered) beats fixed v at the same number of syncs and "
            "matches v = 1",
            "issue 25; Mroueh et al., arXiv 2505.22257 (open problem: v is chosen empirically; "
            "the bound's TV(pi_k, alpha) term)",
            TASK_DRIFT,
            (
                Variant("adaptive", 4, ADAPTIVE),
                Variant("fixed, same syncs", 4, match="adaptive"),
                Variant("v=1", 1),
            ),
            (
                Comparison("better", "adaptive", "fixed, same syncs", "auc"),
                Comparison("equivalent", "adaptive", "v=1"),
            ),
            threshold=0.6,
        ),
        Claim(
            6,
            "Adaptive sync driven by staleness alone (engine numerics measured apart) matches "
            "the mixed drift, and beats fixed v at the same number of syncs",
            "issue 33; verl #7567 (separating staleness from numerics needs alpha scored by "
            "the trainer)",
            TASK_DRIFT,
            (
                Variant("adaptive, staleness", 4, (*ADAPTIVE, *STALENESS)),
                Variant("adaptive, mixed", 4, ADAPTIVE),
                Variant("fixed, same syncs", 4, match="adaptive, staleness"),
            ),
            (
                Comparison("equivalent", "adaptive, staleness", "adaptive, mixed"),
                Comparison("better", "adaptive, staleness", "fixed, same syncs", "auc"),
            ),
            threshold=0.6,
        ),
        Claim(
            7,
            "Dynamic sampling reaches the same reward in fewer trained tokens (sparse success)",
            "Yu et al., DAPO, arXiv 2503.14476 (dynamic sampling reaches the same AIME score "
            "with fewer training steps); issue 43",
            TASK_SPARSE,
            (
                Variant("dynamic sampling", 1, DYNAMIC),
                Variant("every group", 1),
            ),
            (
                Comparison("better", "dynamic sampling", "every group", "auc"),
                Comparison("better", "dynamic sampling", "every group", "final"),
            ),
            threshold=0.3,
        ),
    )
}


@dataclass(frozen=True)
class RunSpec:
    """One distinct training job (a claim variant; shared variants collapse into one)."""

    name: str
    v: int
    overrides: tuple[str, ...]
    match: str | None = None
    """Run name whose syncs set this run's v per seed (``Variant.match``)."""


def matched_sync_interval(steps: int, syncs: int) -> int:
    """The fixed v whose run of ``steps`` steps syncs about ``syncs`` times (at least 1)."""
    return max(1, round(steps / max(syncs, 1)))


def plan_runs(claims: Sequence[int]) -> tuple[list[RunSpec], dict[tuple[int, str], str]]:
    """The distinct runs the claims need, in claim order, and ``(claim, variant) -> run name``."""
    runs: dict[tuple[int, tuple[str, ...], str | None], RunSpec] = {}
    of: dict[tuple[int, str], str] = {}
    for cid in claims:
        c = CLAIMS[cid]
        for var in c.variants:
            match = of[(cid, var.match)] if var.match else None
            key = (var.v, (*c.task, *var.overrides), match)
            if key not in runs:
                slug = re.sub(r"[^A-Za-z0-9]+", "-", var.name).strip("-")
                runs[key] = RunSpec(f"c{cid}-{slug}", var.v, key[1], match)
            of[(cid, var.name)] = runs[key].name
    return list(runs.values()), of
