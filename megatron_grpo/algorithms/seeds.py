"""Every seed a run derives from its two config seeds, one function per random stream.

A run has two seeds: ``seed`` (the trainer: weights, RED-Drop's draws, the mini-batch
order) and ``rollout.seed`` (vLLM's sampling). Each stream derives its seed from one of them
with a constant of its own, and the constants differ because the streams need different
things:

- the trainer's two streams multiply the run seed by a large constant (1_000_003,
  7_654_321) and add the step: a new seed every step, and runs with different seeds far
  apart. The two draw different things (uniform scores, a permutation) from generators of
  their own, so they may share a seed (with ``seed=0`` both are the step itself);
- vLLM's per-step seed adds 7919 (the 1000th prime) per step to ``rollout.seed``: request
  ``i`` of a step then takes ``seed + i * n`` and its n samples ``+0..n-1``
  (``RolloutEngine.generate``), so two steps' samples never share a seed while a step has
  fewer than 7919 samples;
- validation adds 104_729 (the 10000th prime) once, with no step: the same prompts with the
  same seed every time, so the validation figure moves only with the weights;
- a multi-turn episode (``env.name``) is one request per sample: sample ``j`` of request
  ``i`` takes ``seed + i * n + j`` for its first turn, the seed vLLM gives that sample in
  one turn, and turn ``t`` adds ``TURN * t`` (the 100_000th prime, 1_299_709: past the
  samples of 164 steps);
- dynamic sampling (``grpo.dynamic_sampling``) generates a step's further rounds with its
  step seed plus ``ROUND * round`` (the 1_000_000th prime, 15_485_863), and draws their
  prompts from a second pass over the data whose shuffle seed is ``data.shuffle_seed +
  ROUND``;
- each rollout replica (a vLLM engine) offsets its requests by ``1_000_003 * replica``, so
  two engines given the same seed do not sample the same responses.

The values are those the code has always used: the golden numbers of tests/e2e/test_golden.py
depend on them.
"""

from __future__ import annotations

ADVANTAGE = 1_000_003
"""Multiplier of ``seed`` for the group advantages' generator (RED-Drop's random drops)."""
MINI_BATCH = 7_654_321
"""Multiplier of ``seed`` for the mini-batch shuffle of the SGD iterations."""
SAMPLING_STEP = 7919
"""Step stride of vLLM's sampling seed (added to ``rollout.seed``)."""
VALIDATION = 104_729
"""Offset of the validation sampling seed from ``rollout.seed``."""
TURN = 1_299_709
"""Stride of a multi-turn episode's per-turn sampling seed."""
REPLICA = 1_000_003
"""Stride of the per-replica offset of vLLM's request seeds."""
ROUND = 15_485_863
"""Stride of a dynamic-sampling round's sampling seed, and the offset of its data's shuffle."""


def advantage_seed(seed: int, step: int) -> int:
    """Seed of step ``step``'s group-advantage generator (``trainer.loop.group_advantages``)."""
    return seed * ADVANTAGE + step


def mini_batch_seed(seed: int, step: int) -> int:
    """Seed of step ``step``'s mini-batch order (``trainer.loop.train_on``)."""
    return seed * MINI_BATCH + step


def sampling_seed(rollout_seed: int, step: int) -> int:
    """vLLM's sampling seed of trainer step ``step``'s batch (``rollout.ahead``)."""
    return rollout_seed + SAMPLING_STEP * step


def validation_seed(rollout_seed: int) -> int:
    """vLLM's sampling seed of every validation (``eval.interval``): fixed for the run."""
    return rollout_seed + VALIDATION


def replica_offset(replica_index: int) -> int:
    """What rollout replica ``replica_index`` adds to each request's seed."""
    return replica_index * REPLICA


def turn_seed(episode_seed: int, turn: int) -> int:
    """vLLM's seed of turn ``turn`` (0-based) of the episode whose first turn is seeded
    ``episode_seed`` (``rollout.agent``)."""
    return episode_seed + TURN * turn


def round_seed(rollout_seed: int, step: int, round_: int) -> int:
    """vLLM's sampling seed of round ``round_`` (0: the step's own generation) of step
    ``step``'s batch under ``grpo.dynamic_sampling``."""
    return sampling_seed(rollout_seed, step) + ROUND * round_


def refill_shuffle_seed(shuffle_seed: int) -> int:
    """Shuffle seed of the data pass that dynamic sampling's further rounds draw from."""
    return shuffle_seed + ROUND
