"""Rollout samples -> the policy's batch tensors; data-parallel shards and mini-batches.

A GRPO batch is ``prompts_per_step * group_size`` sequences, prompt-major (the G samples of
prompt p sit at rows ``[p*G, (p+1)*G)``); its keys and their meaning:
``megatron_grpo.algorithms.step_batch.StepBatch``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_grpo.algorithms.shaping import overlong_filter_keep
from megatron_grpo.algorithms.step_batch import StepBatch
from megatron_grpo.rollout.samples import Sample


def collate(samples: Sequence[Sample], pad_id: int) -> StepBatch:
    """Stack samples into ``input_ids``, ``attention_mask``, ``loss_mask``, ``rollout_logp``
    ([N, L], L the longest prompt + response), ``response_len`` and ``truncated`` ([N]; True
    where the response hit max_new_tokens, ``finish_reason == "length"``), and when the
    samples carry vLLM's routed experts, ``routed_experts`` (``routed_experts``)."""
    n = len(samples)
    length = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    ids = torch.full((n, length), pad_id, dtype=torch.long)
    attn = torch.zeros(n, length)
    loss_mask = torch.zeros(n, length)
    rollout_logp = torch.zeros(n, length)
    resp_len = torch.zeros(n, dtype=torch.long)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        ids[i, :p] = torch.tensor(s.prompt_ids, dtype=torch.long)
        if r:
            ids[i, p : p + r] = torch.tensor(s.response_ids, dtype=torch.long)
            rollout_logp[i, p : p + r] = torch.tensor(s.logprobs, dtype=torch.float32)
        attn[i, : p + r] = 1
        loss_mask[i, p : p + r] = 1
        resp_len[i] = r
    batch = {
        "input_ids": ids,
        "attention_mask": attn,
        "loss_mask": loss_mask,
        "rollout_logp": rollout_logp,
        "response_len": resp_len,
        "truncated": torch.tensor([s.finish_reason == "length" for s in samples]),
    }
    if samples and samples[0].routed_experts is not None:
        batch["routed_experts"] = routed_experts(samples, length)
    return batch


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


def attach_advantages(batch: StepBatch, adv, overlong_filter: bool) -> None:
    """Put the advantage step's results into ``batch``: ``advantages`` [N]; ``response_mask``,
    every response token (grpo.loss_normalizer=all counts these); ``loss_mask`` keeping only
    the samples the advantage step kept and, with ``overlong_filter`` (DAPO), not those cut
    at max_new_tokens."""
    batch["advantages"] = adv.advantages.reshape(-1)
    batch["response_mask"] = batch["loss_mask"]
    keep = adv.keep.reshape(-1, 1).float()
    if overlong_filter:
        keep = keep * overlong_filter_keep(batch["truncated"]).reshape(-1, 1).float()
    batch["loss_mask"] = batch["loss_mask"] * keep


def select(batch: StepBatch, rows: slice | torch.Tensor) -> StepBatch:
    """The rows ``rows`` of every tensor of ``batch``."""
    return {k: v[rows] for k, v in batch.items()}


def dp_shard(batch: StepBatch, dp_rank: int, dp: int) -> StepBatch:
    """This data-parallel rank's contiguous share of the batch (rows ``[d*N/dp, (d+1)*N/dp)``)."""
    n = batch["input_ids"].shape[0]
    if n % dp:
        raise ValueError(
            f"batch of {n} sequences does not split over data-parallel size {dp}: make "
            "grpo.prompts_per_step * grpo.group_size a multiple of the DP size."
        )
    per = n // dp
    return select(batch, slice(dp_rank * per, (dp_rank + 1) * per))


def mini_batches(
    batch: StepBatch, mini_batch_size: int, dp: int, generator: torch.Generator | None = None
) -> list[StepBatch]:
    """Split this rank's DP shard into mini-batches of ``mini_batch_size`` GLOBAL sequences
    (``mini_batch_size / dp`` on each rank), in a seeded shuffled order when ``generator``
    is given. ``mini_batch_size == 0`` means one mini-batch (the whole batch)."""
    n = batch["input_ids"].shape[0]
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    if mini_batch_size == 0:
        return [select(batch, order)]
    if mini_batch_size % dp:
        raise ValueError(
            f"grpo.mini_batch_size={mini_batch_size} is not a multiple of the data-parallel size "
            f"{dp}: every DP rank must take an equal share of each mini-batch."
        )
    per = mini_batch_size // dp
    return [select(batch, order[i : i + per]) for i in range(0, n, per)]
