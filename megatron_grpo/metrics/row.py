"""One step's ``StepMetrics`` row, built from what the loop's phases returned.

The loop hands over plain results (rewards, the advantage result, the train steps'
metric dicts, the sync report, the phase times) and this module decides what each
metrics.jsonl field means: means over the optimizer steps, the sync's breakdown and
verification fields, the pass rate from the task scores (docs/metrics.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch

from megatron_grpo.metrics.schema import StepMetrics

_TRAIN_EXTRAS = ("ratio_mean", "ratio_min", "ratio_max", "pg_loss", "approx_kl")


def step_row(
    step: int,
    version: int,
    rewards: torch.Tensor,
    reward_info: Mapping[str, Any],
    samples: Sequence[Any],
    adv: Any,
    train: Sequence[Mapping[str, Any]],
    sync_report: Any,
    times: Mapping[str, float],
    t_step: float,
    *,
    sync_verify: Mapping[str, Any] | None = None,
    eval_metrics: Mapping[str, Any] | None = None,
    gpu_memory: Any = None,
    drift: float | None = None,
    ratio_parts: Mapping[str, float] | None = None,
    routing_mismatch: float | None = None,
) -> StepMetrics:
    """Step ``step``'s row. ``version``: the policy version that sampled its batch; ``adv``:
    ``algorithms.advantages``' result (``keep``, ``metrics``); ``train``: one dict per
    optimizer step (``policy.train_step``); ``sync_report``: the bridge's ``SyncReport``
    when the step synced, else None; ``times``: ``PhaseTimer.times()``; ``drift``: the
    step's agreed drift of pi_k from alpha (``trainer.logprobs.measure_drift``), if measured;
    ``ratio_parts``: grpo.off_policy.score_alpha's staleness and numerics metrics
    (``algorithms.staleness.decomposition_metrics``), if measured; ``routing_mismatch``:
    the share of MoE routings where the trainer's router chose other experts than vLLM
    (``rollout.routing_replay``), if measured."""

    mean = partial(_train_mean, train)
    lengths = [s.model_tokens for s in samples]  # an episode's environment tokens excluded
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    task_scores = reward_info["task_scores"]
    extra = _reward_and_train_extras(reward_info, adv, train, times, eval_metrics)
    extra.update(episode_metrics(samples))
    extra.update(ratio_parts or {})
    if routing_mismatch is not None:
        extra["routing_mismatch"] = routing_mismatch
    extra.update(_sync_extras(sync_report, sync_verify))
    return StepMetrics(
        step=step,
        reward_mean=float(rewards.mean()), reward_std=float(rewards.std(unbiased=False)),
        pass_rate=sum(t >= 1.0 for t in task_scores) / len(task_scores),
        synced=sync_report is not None, policy_version=version, lag=step - 1 - version,
        interval_since_sync=step - version, drift=drift,
        sync_bytes=sync_report.bytes if sync_report is not None else 0,
        time_rollout=times.get("time_rollout"), time_reward=times.get("time_reward"),
        time_logprobs=times.get("time_logprobs"), time_train=times.get("time_train"),
        time_sync=times.get("time_sync", 0.0), time_step=t_step,
        response_len_mean=sum(lengths) / len(lengths), response_len_max=max(lengths),
        clip_frac_low=mean("clip_frac_low"), clip_frac_high=mean("clip_frac_high"),
        kl=mean("kl_ref"), entropy=mean("entropy"),
        masked_frac=float((~adv.keep).float().mean()), tokens_per_s=tokens / t_step,
        loss=mean("loss"), grad_norm=train[-1]["grad_norm"] if train else None,
        lr=train[-1]["lr"] if train else None,
        skipped_nan=any(m.get("skipped") for m in train),
        gpu_memory=gpu_memory, extra=extra,
    )  # fmt: skip


def episode_metrics(samples: Sequence[Any]) -> dict[str, Any]:
    """Multi-turn episodes' figures (``env.name``; docs/metrics.md): turns, environment
    calls and how episodes ended, the share of environment tokens; {} for one-turn samples."""
    if not samples or samples[0].response_mask is None:
        return {}
    n = len(samples)
    response = sum(len(s.response_ids) for s in samples)
    ends = [s.env_end for s in samples]
    return {
        "turns_mean": sum(s.turns for s in samples) / n,
        "turns_max": max(s.turns for s in samples),
        "env_calls": sum(s.env_calls for s in samples),
        "env_errors": ends.count("error"),
        "env_timeouts": ends.count("timeout"),
        "env_truncated": ends.count("truncated"),
        "env_token_frac": (response - sum(s.model_tokens for s in samples)) / max(response, 1),
    }


def _train_mean(train: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """``key``'s mean over the optimizer steps that reported it; None when none did."""
    vals = [m[key] for m in train if key in m]
    return sum(vals) / len(vals) if vals else None


def _reward_and_train_extras(
    reward_info: Mapping[str, Any],
    adv: Any,
    train: Sequence[Mapping[str, Any]],
    times: Mapping[str, float],
    eval_metrics: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The first of the row's ``extra`` fields: the reward's own metrics, the advantages'
    (``adv_*``), validation, the eval / score_alpha times, the train steps' extras."""
    extra = {k: v for k, v in reward_info.items() if k not in ("reward_mean", "task_scores")}
    extra.update({f"adv_{k}": v for k, v in adv.metrics.items()})
    extra.update(eval_metrics or {})  # validation of this step (eval.interval), if any
    for key in ("time_eval", "time_score_alpha"):  # validation; alpha's pass (in time_train)
        if key in times:
            extra[key] = times[key]
    extra.update({k: v for k in _TRAIN_EXTRAS if (v := _train_mean(train, k)) is not None})
    return extra


def _sync_extras(sync_report: Any, sync_verify: Mapping[str, Any] | None) -> dict[str, Any]:
    """The sync's bytes, breakdown and verification (``sync.verify``); {} when the step did
    not sync."""
    if sync_report is None:
        return {}
    extra = {
        "sync_seconds": sync_report.seconds,
        "sync_minimal_bytes": sync_report.minimal_bytes,
        "sync_wire_bytes": sync_report.wire_bytes,
    }
    extra.update({f"sync_{k}_s": v for k, v in sync_report.breakdown.items()})
    extra.update(sync_verify or {})
    return extra
