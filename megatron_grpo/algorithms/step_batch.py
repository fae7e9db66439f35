"""A step's data in stages: each a frozen value made once from the one before, never edited.

    SampledBatch     the rollout's samples as tensors         trainer/collate.py ``collate``
    AdvantagedBatch  + each sample's advantage and loss mask  trainer/collate.py ``with_advantages``
    ScoredBatch      + the trainer's log-probs (pi_ref, pi_k, alpha)
                                                               trainer/logprobs.py ``StepLogprobs.score``
    LossBatch        + one mini-batch's global normalizers    trainer/loop.py ``train_on``

Rows are sequences, prompt-major (the G samples of prompt p at rows ``[p*G, (p+1)*G)``);
``[B, L]`` tensors are right-padded and position-aligned: the value of response token j sits
at index ``len(prompt) + j``, and ``logp[b, t]`` is the log-prob of token ``t`` given the
tokens before it. Log-probs are named by their role in the paper (docs/algorithms.md,
"Which log-probs play which role"): ``alpha_engine`` (alpha as the engine served it),
``alpha_trainer`` (alpha scored on the trainer), ``pi_k`` (the trainer's weights before the
step's update), ``pi_ref`` (the KL reference). The policy cuts any stage into micro-batches
of the same type (``select``, ``map_rows``) and hands them to ``loss_fn`` (docs/architecture-policy.md,
"The policy's contracts").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Self, TypeVar

from torch import Tensor

Metrics = dict[str, Tensor]


@dataclass(frozen=True, kw_only=True)
class Normalizers:
    """One mini-batch's loss normalizers over its micro-batches and DP ranks (0-dim float,
    each at least 1: algorithms/aggregation.py ``compute_global_normalizers``)."""

    num_tokens: Tensor
    """loss tokens (``grpo.loss.loss_agg=token_mean``)."""
    num_seqs: Tensor
    """sequences with at least one loss token (the ``seq_mean_*`` modes)."""
    num_rows: Tensor
    """sequences, masked or not (``grpo.loss.loss_agg=constant``)."""

    def parts(self) -> dict[str, Tensor]:
        """The three by name (not ``dataclasses.asdict``, which copies tensors)."""
        return {"num_tokens": self.num_tokens, "num_seqs": self.num_seqs, "num_rows": self.num_rows}


@dataclass(frozen=True, kw_only=True)
class Rows:
    """Per-row tensors of a batch, or of a shard, mini-batch or micro-batch of it: what the
    policy reads to score rows (``Policy.compute_logprobs``)."""

    input_ids: Tensor
    """``[B, L]`` long: prompt + response, right-padded."""
    attention_mask: Tensor | None = None
    """``[B, L]``: 1 on real tokens; gives each row's length (None: every row is full)."""
    routed_experts: Tensor | None = None
    """int16 ``[B, L, MoE layers, top-k]``: the engine's experts of each token, -1 where it
    forwarded none (routing replay, policy/routing_replay.py); None for a dense model."""

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    def map_rows(self, fn: Callable[[str, Tensor], Tensor]) -> Self:
        """A new value of the same stage with ``fn(name, tensor)`` applied to every per-row
        tensor (each ``[B, ...]`` field that is set); other fields as they are."""
        new = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                new[f.name] = fn(f.name, v)
        return dataclasses.replace(self, **new)

    def select(self, rows: slice | Tensor) -> Self:
        """The rows ``rows`` of every per-row tensor."""
        return self.map_rows(lambda _, t: t[rows])

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor the value holds by name, normalizers as ``normalizers.<name>`` (what
        moves to the device, policy/transfer.py)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                out[f.name] = v
            elif isinstance(v, Normalizers):
                out.update({f"{f.name}.{k}": t for k, t in v.parts().items()})
        return out

    def with_tensors(self, moved: Mapping[str, Tensor]) -> Self:
        """This value with its tensors replaced by ``moved`` (``tensors()``, moved)."""
        new: dict[str, object] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor) and f.name in moved:
                new[f.name] = moved[f.name]
            elif isinstance(v, Normalizers):
                parts = {k: moved.get(f"{f.name}.{k}", t) for k, t in v.parts().items()}
                new[f.name] = Normalizers(**parts)
        return dataclasses.replace(self, **new)  # type: ignore[arg-type]  # fields by name

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, L], got shape {tuple(self.input_ids.shape)}")
        b = self.input_ids.shape[0]
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor) and (v.dim() == 0 or v.shape[0] != b):
                raise ValueError(
                    f"{type(self).__name__}.{f.name} has shape {tuple(v.shape)}, input_ids has "
                    f"B={b}: every per-row tensor must have the batch as its first dim."
                )


@dataclass(frozen=True, kw_only=True)
class SampledBatch(Rows):
    """The rollout's samples as tensors (trainer/collate.py ``collate``)."""

    attention_mask: Tensor
    response_mask: Tensor
    """``[B, L]``: 1 on every response token the model sampled, 0 on a multi-turn episode's
    environment tokens and off the response (``grpo.loss.loss_normalizer=all`` counts these)."""
    alpha_engine_logp: Tensor
    """``[B, L]``: alpha's log-probs as the engine returned them with the samples; 0 off the
    response."""
    truncated: Tensor
    """``[B]`` bool: the response hit ``rollout.max_new_tokens``."""


@dataclass(frozen=True, kw_only=True)
class AdvantagedBatch(SampledBatch):
    """The samples with their advantages (trainer/collate.py ``with_advantages``)."""

    advantages: Tensor
    """``[B]``: one per sequence, broadcast over its tokens."""
    loss_mask: Tensor
    """``[B, L]``: the response tokens that get gradient: ``response_mask`` less the samples
    the advantage step (zero variance, RED-Drop) or the overlong filter dropped."""


@dataclass(frozen=True, kw_only=True)
class ScoredBatch(AdvantagedBatch):
    """This rank's shard with the trainer's log-probs its loss reads
    (trainer/logprobs.py ``StepLogprobs.score``; each None when the loss does not read it)."""

    pi_ref_logp: Tensor | None = None
    """``[B, L]``: pi_ref's log-probs (a KL term in the loss)."""
    pi_k_logp: Tensor | None = None
    """``[B, L]``: pi_k's log-probs, scored before the step's first update."""
    alpha_trainer_logp: Tensor | None = None
    """``[B, L]``: alpha's weights scored on the trainer's numerics
    (``grpo.off_policy.score_alpha``, algorithms/staleness.py)."""


@dataclass(frozen=True, kw_only=True)
class LossBatch(ScoredBatch):
    """One mini-batch (or a micro-batch of it) as the loss reads it (trainer/loop.py)."""

    normalizers: Normalizers


S = TypeVar("S", bound=Rows)


def extend(stage: type[S], prior: Rows, **fields: object) -> S:
    """The next stage ``stage`` of ``prior``: every field of ``prior``, and ``fields``."""
    own = {f.name: getattr(prior, f.name) for f in dataclasses.fields(prior) if f.init}
    return stage(**{**own, **fields})


ScoreFn = Callable[[Tensor, Tensor, S], tuple[Tensor, Metrics]]
"""What the policy's forward hands each micro-batch's ``logp``, ``entropy`` and rows (a value
of the batch's stage ``S``) to: the loss (algorithms/aggregation.py ``GRPOLoss``) in a train
step, a collector in a log-prob pass."""
