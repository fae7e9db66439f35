"""One sampled response (``Sample``) and the two ends of a generate on vLLM: the requests
with their ``SamplingParams`` and seeds, and the ``Sample``s made of vLLM's outputs
(docs/rollout.md, ``generate``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_grpo.algorithms.seeds import replica_offset


@dataclass
class Sample:
    """One sampled response."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    """Per response token: logprob of the sampled token under the served policy alpha
    (``raw``: log_softmax of the logits at temperature 1; see rollout/engine.py)."""
    finish_reason: str
    """``"length"`` (hit ``max_new_tokens``) or ``"stop"`` (EOS or a stop token)."""
    weight_version: str | None = None
    """The weight version (``RolloutEngine.weight_version``) the engine held when sampling."""
    routed_experts: Any = None
    """With ``routing_capture``: the experts vLLM routed each forwarded token to, a numpy
    array [prompt + response - 1, MoE layers, top-k] (row t: token t; the last response
    token is never forwarded; rollout/routing_capture.py). None otherwise."""
    response_mask: list[int] | None = None
    """Multi-turn episodes (``env.name``): per response token, 1 where the model sampled it,
    0 where the environment's reply put it (its ``logprobs`` entry is 0.0 and means
    nothing). None: every response token is the model's (one turn)."""
    turns: int = 1
    """Model turns of the episode."""
    env_reward: float | None = None
    """The episode's reward from the environment (its last non-None ``step`` reward; 0.0
    when an environment call failed); None: ``reward.name`` scores the transcript."""
    env_end: str = ""
    """How the episode ended: ``done`` (the environment ended it), ``max_turns``,
    ``truncated`` (the response token budget ran out), ``error``, ``timeout``; empty for
    one-turn samples."""
    env_calls: int = 0
    """Environment calls the episode made (its construction included)."""

    @property
    def model_tokens(self) -> int:
        """Response tokens the model sampled."""
        return len(self.response_ids) if self.response_mask is None else sum(self.response_mask)


def request_seeds(seeds: Sequence[int] | None, base_seed: int, n: int, count: int) -> list[int]:
    """The first seed of each of ``count`` requests of ``n`` samples: ``seeds`` (one per
    request), or ``base_seed + i*n`` without them (its samples take ``+0..n-1``)."""
    if seeds is None:
        return [base_seed + i * n for i in range(count)]
    if len(seeds) != count:
        raise ValueError(
            f"generate: {len(seeds)} seeds for {count} prompts; pass one seed per prompt."
        )
    return list(seeds)


def sampling_requests(
    prompt_token_ids: Sequence[Sequence[int]],
    seeds: Sequence[int] | None,
    base_seed: int,
    replica_index: int,
    *,
    n: int,
    temperature: float,
    top_p: float,
    top_k: int,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] | None,
    stop: Sequence[str] | None = None,
    max_tokens_each: Sequence[int] | None = None,
) -> tuple[list[dict[str, Any]], list[Any]]:
    """vLLM's requests (one per prompt) and their ``SamplingParams``: request i is seeded
    ``seeds[i]``, or ``base_seed + i*n`` without ``seeds``, plus the replica's offset
    (``RolloutEngine.generate``). ``stop``: strings that end a completion besides the stop
    tokens (kept in its tokens); ``max_tokens_each``: request i's own token limit instead
    of ``max_new_tokens`` (a multi-turn episode's remaining budget)."""
    from vllm import SamplingParams

    replica = replica_offset(replica_index)
    seeds = request_seeds(seeds, base_seed, n, len(prompt_token_ids))
    requests, params = [], []
    for i, ids in enumerate(prompt_token_ids):
        requests.append({"prompt_token_ids": list(ids)})
        params.append(
            SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k if top_k and top_k > 0 else 0,
                max_tokens=max_new_tokens if max_tokens_each is None else max_tokens_each[i],
                seed=seeds[i] + replica,
                logprobs=0,  # the sampled token's logprob only
                stop_token_ids=list(stop_token_ids) if stop_token_ids else None,
                **({"stop": list(stop), "include_stop_str_in_output": True} if stop else {}),
            )
        )
    return requests, params


def samples_of(
    requests: list[dict[str, Any]], outputs: list[Any], version: str, routed: dict | None
) -> list[Sample]:
    """The ``Sample``s of vLLM's ``outputs`` (one per request, its ``n`` completions in
    index order), prompt-major; ``routed``: the captured experts (``take_routed``) or None."""
    samples: list[Sample] = []
    for req, out in zip(requests, outputs):
        for comp in sorted(out.outputs, key=lambda c: c.index):
            ids = list(comp.token_ids)
            if comp.logprobs is None or len(comp.logprobs) != len(ids):
                raise RuntimeError(
                    f"vLLM returned {0 if comp.logprobs is None else len(comp.logprobs)} "
                    f"logprobs for {len(ids)} tokens; expected one per token."
                )
            lps = [step[tok].logprob for tok, step in zip(ids, comp.logprobs)]
            reason = "length" if comp.finish_reason == "length" else "stop"
            sample = Sample(req["prompt_token_ids"], ids, lps, reason, weight_version=version)
            if routed is not None:
                from megatron_grpo.rollout.routing_capture import routed_rows

                sample.routed_experts = routed_rows(
                    routed, out.request_id, comp.index, len(ids) + len(sample.prompt_ids) - 1
                )
            samples.append(sample)
    return samples
