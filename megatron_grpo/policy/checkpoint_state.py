"""A policy's checkpoint state in megatron's dist_checkpointing form: the model chunks, the
optimizer in a format that reshards (``OPTIMIZER_CKPT_FORMAT``), the LR schedule, the load
template a fresh distributed optimizer needs, and the load itself
(docs/checkpointing.md "What is saved").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from megatron_grpo.policy.optimizer import set_fused_adam

if TYPE_CHECKING:
    from megatron_grpo.policy.optimizer import TrainingParts

OPTIMIZER_CKPT_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}
"""``metadata`` for megatron's optimizer ``sharded_state_dict`` (read by the distributed
optimizer; the plain optimizers take and ignore it): see ``sharded_state``."""


def _subs(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


@contextlib.contextmanager
def torch_adam_step_kept(optimizer: Any) -> Iterator[None]:
    """Let megatron-core 0.16.1's DistributedOptimizer load a ``fully_reshardable`` state into
    torch's Adam (the optimizer megatron uses without TE or Apex) exactly. Two faults of its
    distrib_optimizer.py are answered, both only while the block runs:

    - ``load_parameter_state_from_fully_reshardable`` drops each parameter's ``step`` from the
      loaded tensors, and ``_set_main_param_and_optimizer_states`` then copies every key of
      the live state, ``step`` included, from them: ``KeyError: 'step'``. ``step`` was
      already restored by ``load_state_dict`` (from the param groups, before the parameter
      state), so the live ``step`` is handed back to that copy, which leaves it as restored.
    - that ``load_state_dict`` gives every parameter the SAME ``step`` tensor; torch's Adam
      increments each parameter's ``step`` in place, so the shared counter would advance once
      per parameter per step and skew Adam's bias correction after a resume. Each parameter
      gets its own copy at the end (the plain optimizer deep-copies it the same way:
      optimizer.py ``_restore_common_per_param_step``)."""
    subs = [s for s in _subs(optimizer) if hasattr(s, "_set_main_param_and_optimizer_states")]

    def keep_step(
        sub: Any, original: Callable[[Any, dict[str, Any]], None]
    ) -> Callable[[Any, dict[str, Any]], None]:
        def set_states(model_param: Any, tensors: dict[str, Any]) -> None:
            if "step" not in tensors:
                group, order = sub.model_param_group_index_map[model_param]
                live = sub.optimizer.state[sub.optimizer.param_groups[group]["params"][order]]
                if "step" in live:
                    tensors = {**tensors, "step": live["step"]}
            return original(model_param, tensors)

        return set_states

    for sub in subs:
        sub._set_main_param_and_optimizer_states = keep_step(
            sub, sub._set_main_param_and_optimizer_states
        )
    try:
        yield
    finally:
        for sub in subs:
            del sub._set_main_param_and_optimizer_states  # the class's method again
            for st in sub.optimizer.state.values():
                if torch.is_tensor(st.get("step")):
                    st["step"] = st["step"].clone()


@torch.no_grad()
def init_distributed_optimizer_state(optimizer: Any) -> None:
    """Give a fresh DistributedOptimizer's inner optimizer zero Adam state and step 0.

    Its ``sharded_state_dict(is_loading=True)`` calls its own ``state_dict()``, which
    reads one common ``step`` from the inner optimizer's per-parameter state and asserts
    there is exactly one (megatron/core/optimizer/distrib_optimizer.py ``state_dict``);
    torch's Adam has no state before its first step. The values are placeholders that
    the load overwrites (megatron's ``_init_optimizer_states_with_dummy_values`` would
    run a real step instead, which weight decay turns into a change of the weights)."""
    for sub in _subs(optimizer):
        inner = getattr(sub, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                if not st:
                    # Where torch's Adam keeps it: on the device when fused (adam.py _init_group)
                    st["step"] = torch.tensor(0.0, device=p.device if group.get("fused") else "cpu")
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)


def sharded_state(
    models: list[Any], parts: TrainingParts | None = None, for_loading: bool = False
) -> dict[str, Any]:
    """megatron dist_checkpointing state: ``model`` (``model0``, ``model1``... with vpp), and
    with ``parts`` (a trainable policy's DDP chunks, optimizer and schedule) ``optimizer`` and
    ``lr_schedule``.

    ``for_loading=True`` builds the template to load into: a fresh optimizer has no Adam
    moments yet, and megatron's ``sharded_state_dict(..., is_loading=True)`` creates their
    entries so they are restored (without it they are silently skipped and a resumed step
    drifts; megatron/core/optimizer/optimizer.py).

    The distributed optimizer saves in megatron's ``fully_reshardable`` format
    (``OPTIMIZER_CKPT_FORMAT``): its state in model space, one tensor per parameter and
    moment like the plain optimizer's, so a checkpoint reshards across TP, PP and DP alike
    (docs/checkpointing.md). megatron's default without ``metadata``,
    ``fully_sharded_model_space``, is deprecated and refused by 0.16.1's own
    dist_checkpointing ("ShardedTensor.flattened_range is not supported")."""
    state: dict[str, Any] = {}
    if len(models) == 1:
        state["model"] = models[0].sharded_state_dict()
    else:
        for i, m in enumerate(models):
            state[f"model{i}"] = m.sharded_state_dict()
    if parts is not None:
        model_sd: dict[str, Any] = {}
        for k in [k for k in state if k.startswith("model")]:
            model_sd.update(state[k])
        if for_loading and parts.distributed_optimizer:
            init_distributed_optimizer_state(parts.optimizer)
        state["optimizer"] = parts.optimizer.sharded_state_dict(
            model_sd, is_loading=for_loading, metadata=OPTIMIZER_CKPT_FORMAT
        )
        state["lr_schedule"] = parts.scheduler.state_dict()
    return state


@torch.no_grad()
def load_sharded_state(
    models: list[Any], parts: TrainingParts | None, state: dict[str, Any]
) -> None:
    """Apply a state loaded by ``dist_checkpointing.load(sharded_state(...), ...)``.

    Under ``no_grad``: the distributed optimizer copies into its main params, which are
    views of leaf parameters in fp32 (an in-place op autograd refuses otherwise)."""
    if len(models) == 1:
        models[0].load_state_dict(state["model"], strict=True)
    else:
        for i, m in enumerate(models):
            m.load_state_dict(state[f"model{i}"], strict=True)
    if parts is None:
        return
    if "optimizer" in state:
        with torch_adam_step_kept(parts.optimizer):
            parts.optimizer.load_state_dict(state["optimizer"])
    else:
        # Weights only: the fp32 main params must follow the loaded model params.
        parts.optimizer.reload_model_params()
    # The run's optim.fused_adam, not the one the checkpoint was saved with (torch's
    # load_state_dict restores the saved param groups' flags).
    set_fused_adam(parts.optimizer, parts.fused_adam)
    if "lr_schedule" in state:
        parts.scheduler.load_state_dict(state["lr_schedule"])
