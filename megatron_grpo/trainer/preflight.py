"""Every check of a training run that can fail, run before anything expensive.

Called by each rank first thing (``trainer.build.build_trainer``), and by ``megatron-grpo
train`` run as one process before it starts the ranks: the model's split over parallel.tp /
pp (a preset's shape too, first: no number of ranks fixes it), the layout against the world
size, the expert split, the wandb package when ``logging.wandb_project`` asks for it, the loss
and the reward (a user's loss class or reward function is imported), and the data (read and
validated without a tokenizer; the prompt length check, which needs the tokenizer, comes
later), a multi-turn environment's class (imported). Each failure is one ConfigError line.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging

from megatron_grpo.algorithms.aggregation import make_loss_fn
from megatron_grpo.config import Config, ConfigError
from megatron_grpo.data import build_prompt_source
from megatron_grpo.distributed.placement import validate_world
from megatron_grpo.distributed.setup import rank_device
from megatron_grpo.distributed.validate import check_experts, check_model_split
from megatron_grpo.environments.contract import load_environment
from megatron_grpo.layouts import vllm as vl
from megatron_grpo.models.prepare import check_model_path
from megatron_grpo.models.shapes import resolve_spec
from megatron_grpo.models.spec import ModelSpec, check_heads
from megatron_grpo.policy.kernels import resolve_kernels
from megatron_grpo.rewards import check_reward


def check_run(cfg: Config, world_size: int) -> int:
    """Raise ConfigError for a run that cannot start; return the number of vLLM engines."""
    check_model_path(cfg)
    spec = resolve_spec(cfg.model.hf_path)[0]  # a preset's shape too, before it is built
    par = cfg.parallel
    check_model_split(spec, par.tp, par.pp, par.vpp)  # first: no world size fixes it
    try:
        check_heads(spec, par.tp, cfg.rollout.tp)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    engines = validate_world(cfg, world_size)
    check_moe(spec, cfg)
    check_wandb(cfg)
    kernels = resolve_kernels(cfg.model, rank_device(cfg.parallel))  # liger/compile/TE run here
    if cfg.parallel.cp > 1 and kernels.impl == "transformer_engine":
        raise ConfigError(
            f"parallel.cp={cfg.parallel.cp} runs in the project's own attention, and "
            "model.transformer_impl=auto picked Transformer Engine (installed, on CUDA): set "
            "model.transformer_impl=local."
        )
    data = cfg.data
    if data.template == "chat":  # needs the model's tokenizer: checked when it is loaded
        data = dataclasses.replace(data, template="{prompt}")
    try:
        make_loss_fn(cfg.grpo, cfg.rollout.max_new_tokens)  # a user's loss class is imported
        check_reward(cfg.reward, cfg.data)
        if cfg.env.multi_turn:  # a user's environment class is imported
            load_environment(cfg.env.name)
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


def check_wandb(cfg: Config) -> None:
    """``logging.wandb_project`` needs the wandb package (imported by the logger, which
    starts after the model and vLLM)."""
    project = cfg.logging.wandb_project
    if project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"logging.wandb_project={project!r} but the wandb package is not installed: "
            "`pip install wandb`, or set logging.wandb_project=null."
        )


def check_moe(spec: ModelSpec, cfg: Config, has_cuda: bool | None = None) -> None:
    """The expert split (``parallel.ep``) of an MoE model, its TP, vLLM's expert
    parallelism and routing replay (docs/moe.md). ``has_cuda``: default, whether the ranks
    get a GPU (``rank_device``)."""
    par = cfg.parallel
    check_experts(spec, par.ep, par.tp)
    check_rollout_ep(spec, cfg, has_cuda)
    if spec.is_moe and par.tp > 1 and not par.sequence_parallel:
        # megatron's MoELayer.forward raises in training with TP > 1 and no sequence
        # parallelism (transformer/moe/moe_layer.py); scoring alone would run
        raise ConfigError(
            f"parallel.tp({par.tp}) > 1 with an MoE model needs parallel.sequence_parallel="
            "true (megatron's MoE layer refuses to train under TP without it): set "
            "parallel.sequence_parallel=true, or parallel.tp=1 and split the experts with "
            "parallel.ep."
        )
    widths = {
        "moe_intermediate_size": spec.moe_ffn_hidden_size,
        "shared_expert_intermediate_size": spec.shared_expert_ffn_hidden_size,
    }
    for key, width in widths.items():
        if key == "moe_intermediate_size" and cfg.rollout.expert_parallel:
            continue  # whole experts on each vLLM rank
        if spec.is_moe and width % cfg.rollout.tp:  # vLLM splits every expert over its TP
            raise ConfigError(
                f"rollout.tp({cfg.rollout.tp}) does not divide the model's {key}({width}): "
                "every vLLM rank holds 1/tp of each expert; pick a rollout.tp that divides it."
            )
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


def check_rollout_ep(spec: ModelSpec, cfg: Config, has_cuda: bool | None = None) -> None:
    """``rollout.expert_parallel``: an MoE model, a GPU, and an expert for every vLLM rank."""
    r = cfg.rollout
    if not r.expert_parallel:
        return
    if not spec.is_moe:
        raise ConfigError(
            f"rollout.expert_parallel=true needs a mixture-of-experts model, and "
            f"{cfg.model.hf_path} is dense: set rollout.expert_parallel=false."
        )
    cuda = rank_device(cfg.parallel).type == "cuda" if has_cuda is None else has_cuda
    if not cuda:
        raise ConfigError(
            "rollout.expert_parallel=true needs a GPU: vLLM's CPU MoE kernel ignores the expert "
            "map and crashes under enable_expert_parallel; set rollout.expert_parallel=false."
        )
    try:
        vl.validate(spec, r.tp, expert_parallel=True)
    except ValueError as e:
        raise ConfigError(f"rollout.expert_parallel=true: {e} Lower rollout.tp.") from None
