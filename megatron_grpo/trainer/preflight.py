"""Every check of a training run that can fail, run before anything expensive.

Called by each rank first thing (``GRPOTrainer``), and by ``megatron-grpo train`` run as one
process before it starts the ranks: layout against the world size, the reward (a user
function is imported), and the data (read and validated without a tokenizer; the prompt
length check, which needs the tokenizer, comes later). Each failure is one ConfigError line.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from megatron_grpo.config import Config, ConfigError
from megatron_grpo.data import build_prompt_source
from megatron_grpo.distributed.placement import validate_world
from megatron_grpo.distributed.setup import check_experts
from megatron_grpo.models.prepare import check_model_path
from megatron_grpo.models.shapes import resolve_spec
from megatron_grpo.models.spec import ModelSpec, check_heads, load_spec
from megatron_grpo.rewards import check_reward


def check_run(cfg: Config, world_size: int) -> int:
    """Raise ConfigError for a run that cannot start; return the number of vLLM engines."""
    engines = validate_world(cfg, world_size)
    check_model_path(cfg)
    hf = Path(cfg.model.hf_path)
    if (hf / "config.json").is_file():  # a preset's shape is checked when it is built
        try:
            check_heads(load_spec(hf), cfg.parallel.tp, cfg.rollout.tp)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    check_moe(resolve_spec(cfg.model.hf_path)[0], cfg)
    data = cfg.data
    if data.template == "chat":  # needs the model's tokenizer: checked when it is loaded
        data = dataclasses.replace(data, template="{prompt}")
    try:
        check_reward(cfg.reward, cfg.data)
        quiet = logging.getLogger("megatron_grpo.data")  # the rows-skipped note comes later
        level, quiet.level = quiet.level, logging.ERROR
        try:
            build_prompt_source(data, tokenizer=None)
        finally:
            quiet.setLevel(level)
    except FileNotFoundError:
        raise
    except (ValueError, KeyError) as e:
        raise ConfigError(str(e).strip().splitlines()[0] if str(e).strip() else repr(e)) from e
    return engines


def check_moe(spec: ModelSpec, cfg: Config) -> None:
    """The expert split (``parallel.ep``) of an MoE model, and routing replay (docs/moe.md)."""
    check_experts(spec, cfg.parallel.ep, cfg.parallel.tp)
    replay = cfg.rollout.routing_replay
    if replay != "off" and not spec.num_experts:
        raise ConfigError(
            f"rollout.routing_replay={replay} needs a mixture-of-experts model, but "
            f"{cfg.model.hf_path} is dense (no experts to route): set "
            "rollout.routing_replay=off."
        )
    if replay != "off" and cfg.model.recompute != "none":
        raise ConfigError(
            f"rollout.routing_replay={replay} with model.recompute={cfg.model.recompute}: "
            "the recomputed forward in the backward pass would not see the micro-batch's "
            "routed experts; set model.recompute=none or rollout.routing_replay=off."
        )
