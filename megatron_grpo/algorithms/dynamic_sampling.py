"""DAPO's dynamic sampling (Yu et al., arXiv 2503.14476; ``grpo.dynamic_sampling``): which of
a step's generated groups it trains on.

A group whose G rewards are all equal has zero advantage under every advantage this project
computes, so it adds no gradient and only costs compute. With dynamic sampling on, a step
generates its prompts in rounds (``rollout.ahead.WindowBuffer`` runs them), and
``fill_batch`` picks the batch from what the rounds returned:

- the groups whose rewards differ (*signal*), in the order they were generated (round by
  round, prompt by prompt), up to ``prompts_per_step``;
- when the rounds ran out first, the batch is made up to ``prompts_per_step`` with the
  zero-variance groups in the same order, which the zero-variance mask leaves without
  gradient; ``ds_fill`` < 1 says the step was short.

Everything here is a function of the rounds' rewards, so a step picks the same groups on
every rank and in a resumed run. The row's figures (docs/metrics.md): ``ds_generated``,
``ds_signal`` (groups generated with rewards that differ), ``ds_rounds``, ``ds_fill`` (the
batch's share of groups with signal) and ``ds_reward_mean`` (the mean reward over every
generated response, the unbiased counterpart of ``reward_mean``, which is the trained
batch's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Round:
    """One round of a step's generation: its prompts, their ``G`` samples each
    (prompt-major), and ``GroupScorer``'s ``(rewards [P, G], info)`` of them."""

    prompts: list[Any]
    samples: list[Any]
    rewards: torch.Tensor
    info: dict[str, Any]


def has_signal(rewards_PG: torch.Tensor) -> list[bool]:
    """Per group: do its rewards differ (a non-zero advantage somewhere in the group)?"""
    return (rewards_PG.amax(dim=1) > rewards_PG.amin(dim=1)).tolist()


def signal_count(rounds: Sequence[Round]) -> int:
    """Groups with signal over ``rounds``: the batch is full once this reaches P."""
    return sum(sum(has_signal(r.rewards)) for r in rounds)


def fill_batch(
    rounds: Sequence[Round], prompts_per_step: int
) -> tuple[list[Any], list[Any], tuple[torch.Tensor, dict[str, Any]]]:
    """The step's ``(prompts, samples, (rewards [P, G], info))`` picked from ``rounds``
    (module docstring). ``info``: each round's reward info merged (``merge_info``) with the
    per-response lists cut to the picked groups, plus the ``ds_*`` figures."""
    flags = [
        (r, i, s) for r, rnd in enumerate(rounds) for i, s in enumerate(has_signal(rnd.rewards))
    ]
    signal = [(r, i) for r, i, s in flags if s]
    flat = [(r, i) for r, i, s in flags if not s]
    if len(signal) + len(flat) < prompts_per_step:
        raise ValueError(
            f"dynamic sampling generated {len(flags)} groups, fewer than the step's "
            f"prompts_per_step={prompts_per_step}: each round must generate at least that many."
        )
    picks = (signal + flat)[:prompts_per_step]
    g = rounds[0].rewards.shape[1]
    prompts = [rounds[r].prompts[i] for r, i in picks]
    samples = [s for r, i in picks for s in rounds[r].samples[i * g : (i + 1) * g]]
    rewards = torch.stack([rounds[r].rewards[i] for r, i in picks])
    info = merge_info([r.info for r in rounds], [r.rewards.shape[0] * g for r in rounds], picks, g)
    generated = torch.cat([r.rewards.reshape(-1) for r in rounds])
    info.update(
        ds_generated=len(flags),
        ds_signal=len(signal),
        ds_rounds=len(rounds),
        ds_fill=min(len(signal), prompts_per_step) / prompts_per_step,
        ds_reward_mean=float(generated.mean()),
    )
    return prompts, samples, (rewards, info)


def merge_info(
    infos: Sequence[dict[str, Any]],
    sizes: Sequence[int],
    picks: Sequence[tuple[int, int]],
    group_size: int,
) -> dict[str, Any]:
    """The reward functions' infos of several rounds as one: a per-response list (as long as
    its round's responses: ``task_scores``) keeps the picked groups' entries in pick order;
    a ``total_*`` figure is the last round's (a running total); other integers (counts:
    ``errors``, ``timeouts``) add up; other numbers (means: ``task_mean``) are the mean over
    every generated response. ``picks``: ``(round, group)`` of each picked group, in order;
    ``sizes``: each round's responses."""
    out: dict[str, Any] = {}
    n = sum(sizes)
    for key, first in infos[0].items():
        values: list[Any] = [info.get(key, first) for info in infos]
        if isinstance(first, list) and all(
            isinstance(v, list) and len(v) == size for v, size in zip(values, sizes)
        ):
            out[key] = [values[r][i * group_size + j] for r, i in picks for j in range(group_size)]
        elif key.startswith("total_"):
            out[key] = values[-1]
        elif isinstance(first, bool) or not isinstance(first, (int, float)):
            out[key] = first
        elif isinstance(first, int):
            out[key] = sum(values)
        else:
            out[key] = sum(v * size for v, size in zip(values, sizes)) / n
    return out
