"""Which global ranks train and which serve vLLM, from the config and the world size.

- ``colocated``: every rank trains and hosts one vLLM TP rank in-process (external_launcher);
  engine ``e`` is the consecutive ranks ``[e*tp, (e+1)*tp)`` (``bridge.weight_sync``'s
  ``colocated_engine_ranks``).
- ``disaggregated``: the LAST ``rollout.num_engines * rollout.tp`` ranks serve, engine ``e``
  being consecutive ranks again; every rank before them trains. With torchrun on Slurm the
  ranks of one node are consecutive, so when the rollout ranks are a multiple of the GPUs
  per node they are whole nodes: the last nodes of the allocation
  (``slurm/disaggregated.sbatch``). The trainer should use ``place_ranks`` for the same split.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_grpo.config.schema import ConfigError, RolloutConfig


@dataclass(frozen=True)
class RankPlacement:
    placement: str
    world_size: int
    train_ranks: list[int]
    rollout_ranks: list[int]
    engines: list[list[int]]
    """``engines[e][r]``: global rank hosting TP rank ``r`` of vLLM engine ``e``."""


def place_ranks(rollout: RolloutConfig, world_size: int) -> RankPlacement:
    tp = rollout.tp
    if rollout.placement == "colocated":
        if world_size % tp:
            raise ConfigError(
                f"rollout.tp({tp}) does not divide the world size {world_size}: colocated "
                f"engines take consecutive groups of rollout.tp ranks; pick a divisor of "
                f"{world_size}."
            )
        ranks = list(range(world_size))
        engines = [ranks[e * tp : (e + 1) * tp] for e in range(world_size // tp)]
        return RankPlacement("colocated", world_size, ranks, ranks, engines)
    if rollout.num_engines < 1:
        raise ConfigError(
            "rollout.placement=disaggregated needs rollout.num_engines >= 1 to know how many "
            f"ranks serve: set rollout.num_engines=E (E * rollout.tp({tp}) ranks serve vLLM)."
        )
    serving = rollout.num_engines * tp
    if serving >= world_size:
        raise ConfigError(
            f"rollout.num_engines({rollout.num_engines}) * rollout.tp({tp}) = {serving} "
            f"rollout ranks leave no trainer rank in a world of {world_size}: launch more "
            "nodes or serve with fewer engines."
        )
    first = world_size - serving
    rollout_ranks = list(range(first, world_size))
    engines = [rollout_ranks[e * tp : (e + 1) * tp] for e in range(rollout.num_engines)]
    return RankPlacement("disaggregated", world_size, list(range(first)), rollout_ranks, engines)
