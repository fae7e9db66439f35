"""Which global ranks train and which serve vLLM, from the config and the world size.

- ``colocated``: every rank trains and hosts one vLLM TP rank in-process (external_launcher);
  engine ``e`` is the consecutive ranks ``[e*tp, (e+1)*tp)`` (``colocated_engines``).
- ``disaggregated``: the LAST ``rollout.num_engines * rollout.tp`` ranks serve, engine ``e``
  being consecutive ranks again; every rank before them trains. With torchrun on Slurm the
  ranks of one node are consecutive, so when the rollout ranks are a multiple of the GPUs
  per node they are whole nodes: the last nodes of the allocation
  (``slurm/disaggregated.sbatch``). The trainer should use ``place_ranks`` for the same split.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_grpo.config import Config
from megatron_grpo.config.schema import ConfigError, RolloutConfig
from megatron_grpo.distributed.validate import validate_parallel


@dataclass(frozen=True)
class RankPlacement:
    placement: str
    world_size: int
    train_ranks: list[int]
    rollout_ranks: list[int]
    engines: list[list[int]]
    """``engines[e][r]``: global rank hosting TP rank ``r`` of vLLM engine ``e``."""


def colocated_engines(world_size: int, tp: int) -> list[list[int]]:
    """Global ranks of each colocated engine's TP ranks (vLLM's external_launcher layout)."""
    if world_size % tp:
        raise ConfigError(
            f"rollout.tp({tp}) does not divide the world size {world_size}: colocated "
            f"engines take consecutive groups of rollout.tp ranks; pick a divisor of "
            f"{world_size}."
        )
    return [list(range(e * tp, (e + 1) * tp)) for e in range(world_size // tp)]


def place_ranks(rollout: RolloutConfig, world_size: int) -> RankPlacement:
    tp = rollout.tp
    if rollout.placement == "colocated":
        ranks = list(range(world_size))
        engines = colocated_engines(world_size, tp)
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


def validate_world(cfg: Config, world_size: int) -> int:
    """The run's layout against the world size, before anything is built; returns the
    number of vLLM engines. The one place the world is checked: the trainer's parallel
    layout (colocated: every rank trains), the engines' placement (``place_ranks``), what
    a placement cannot do, and the prompts' split over the engines."""
    if cfg.rollout.placement == "colocated":
        validate_parallel(cfg.parallel, world_size)  # now, not after the warm start
    engines = len(place_ranks(cfg.rollout, world_size).engines)
    if cfg.rollout.placement == "disaggregated":
        if cfg.sync.method != "direct":
            raise ConfigError(
                f"sync.method={cfg.sync.method!r} gathers full tensors into in-process vLLM "
                "ranks (colocated only): set sync.method=direct with rollout.placement="
                "disaggregated."
            )
        if cfg.sync.verify:
            raise ConfigError(
                "sync.verify=true reads vLLM's checksums and prompt log-probs in process "
                "(colocated only): set sync.verify=false with rollout.placement=disaggregated."
            )
        source = f"rollout.num_engines({engines})"
    else:
        source = (
            f"the {engines} colocated vLLM engines (WORLD_SIZE {world_size} / rollout.tp "
            f"{cfg.rollout.tp})"
        )
    if cfg.grpo.batch.prompts_per_step % engines:
        raise ConfigError(
            f"grpo.batch.prompts_per_step({cfg.grpo.batch.prompts_per_step}) is not a multiple of "
            f"{source}: "
            f"make it a multiple of {engines}."
        )
    return engines
