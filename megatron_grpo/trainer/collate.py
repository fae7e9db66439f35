"""Rollout samples -> the step's first two stages (``SampledBatch``, ``AdvantagedBatch``);
data-parallel shards and mini-batches of any stage.

A GRPO batch is ``prompts_per_step * group_size`` sequences, prompt-major (the G samples of
prompt p sit at rows ``[p*G, (p+1)*G)``); its fields and their meaning:
``megatron_grpo.algorithms.step_batch``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

from megatron_grpo.algorithms.advantages import Advantages
from megatron_grpo.algorithms.shaping import overlong_filter_keep
from megatron_grpo.algorithms.step_batch import AdvantagedBatch, Rows, SampledBatch, extend
from megatron_grpo.rollout.samples import Sample


def collate(samples: Sequence[Sample], pad_id: int) -> SampledBatch:
    """Stack samples into ``input_ids``, ``attention_mask``, ``response_mask`` (the tokens the
    model sampled: a multi-turn episode's environment tokens are 0),
    ``alpha_engine_logp`` ([N, L], L the longest prompt + response) and ``truncated`` ([N];
    True where the response hit max_new_tokens, ``finish_reason == "length"``), and when the
    samples carry vLLM's routed experts, ``routed_experts``."""
    n = len(samples)
    length = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    ids = torch.full((n, length), pad_id, dtype=torch.long)
    attn = torch.zeros(n, length)
    response_mask = torch.zeros(n, length)
    alpha_logp = torch.zeros(n, length)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        ids[i, :p] = torch.tensor(s.prompt_ids, dtype=torch.long)
        if r:
            ids[i, p : p + r] = torch.tensor(s.response_ids, dtype=torch.long)
            alpha_logp[i, p : p + r] = torch.tensor(s.logprobs, dtype=torch.float32)
        attn[i, : p + r] = 1
        if s.response_mask is None:
            response_mask[i, p : p + r] = 1
        elif r:  # a multi-turn episode: the environment's tokens are context, not actions
            response_mask[i, p : p + r] = torch.tensor(s.response_mask, dtype=torch.float32)
    routed = bool(samples) and samples[0].routed_experts is not None
    return SampledBatch(
        input_ids=ids,
        attention_mask=attn,
        response_mask=response_mask,
        alpha_engine_logp=alpha_logp,
        truncated=torch.tensor([s.finish_reason == "length" for s in samples]),
        routed_experts=routed_experts(samples, length) if routed else None,
    )


def routed_experts(samples: Sequence[Sample], length: int) -> torch.Tensor:
    """vLLM's experts per token, position-aligned: int16 [N, L, MoE layers, top-k], -1 where
    vLLM forwarded no token (each row's last token, padding): the router's own choice there
    (policy/routing_replay.py)."""
    layers, k = samples[0].routed_experts.shape[1:]
    out = torch.full((len(samples), length, layers, k), -1, dtype=torch.int16)
    for i, s in enumerate(samples):
        rows = torch.from_numpy(s.routed_experts.astype("int16"))
        out[i, : rows.shape[0]] = rows
    return out


def with_advantages(batch: SampledBatch, adv: Advantages, overlong_filter: bool) -> AdvantagedBatch:
    """The samples with the advantage step's results: ``advantages`` [N] and ``loss_mask``,
    the response tokens of the samples the advantage step kept and, with ``overlong_filter``
    (DAPO), not cut at max_new_tokens."""
    keep = adv.keep.reshape(-1, 1).float()
    if overlong_filter:
        keep = keep * overlong_filter_keep(batch.truncated).reshape(-1, 1).float()
    return extend(
        AdvantagedBatch,
        batch,
        advantages=adv.advantages.reshape(-1),
        loss_mask=batch.response_mask * keep,
    )


R = TypeVar("R", bound=Rows)


def dp_rows(n: int, dp_rank: int, dp: int) -> slice:
    """This data-parallel rank's contiguous share of ``n`` rows (``[d*n/dp, (d+1)*n/dp)``)."""
    if n % dp:
        raise ValueError(
            f"batch of {n} sequences does not split over data-parallel size {dp}: make "
            "grpo.batch.prompts_per_step * grpo.group_size a multiple of the DP size."
        )
    per = n // dp
    return slice(dp_rank * per, (dp_rank + 1) * per)


def dp_shard(batch: R, dp_rank: int, dp: int) -> R:
    """This data-parallel rank's contiguous share of the batch (``dp_rows``)."""
    return batch.select(dp_rows(batch.num_rows, dp_rank, dp))


def mini_batches(
    batch: R, mini_batch_size: int, dp: int, generator: torch.Generator | None = None
) -> list[R]:
    """Split this rank's DP shard into mini-batches of ``mini_batch_size`` GLOBAL sequences
    (``mini_batch_size / dp`` on each rank), in a seeded shuffled order when ``generator``
    is given. ``mini_batch_size == 0`` means one mini-batch (the whole batch)."""
    n = batch.num_rows
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    if mini_batch_size == 0:
        return [batch.select(order)]
    if mini_batch_size % dp:
        raise ValueError(
            f"grpo.batch.mini_batch_size={mini_batch_size} is not a multiple of the data-parallel "
            "size "
            f"{dp}: every DP rank must take an equal share of each mini-batch."
        )
    per = mini_batch_size // dp
    return [batch.select(order[i : i + per]) for i in range(0, n, per)]
