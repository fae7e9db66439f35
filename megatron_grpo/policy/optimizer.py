"""Training setup of a policy's model chunks: megatron's DDP wrappers, its optimizer (plain
or distributed, torch's AdamW fused or not), the LR schedule that drives it, and gradient
clipping (docs/architecture-policy.md, "The optimizer").

The gradient contract these serve (no rescaling by megatron) is in the docstring of
``megatron_grpo/policy/policy.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_grpo.config.schema import OptimConfig
from megatron_grpo.distributed.setup import ParallelContext
from megatron_grpo.policy.lr_schedule import LRSchedule


def finalize_grads_without_token_scaling(
    model: list[Any], num_tokens: torch.Tensor | None, pg_collection: Any = None, **kwargs: Any
) -> None:
    """megatron's finalize_model_grads (DP all-reduce, tied-embedding all-reduce across PP
    stages) with ``num_tokens=None``: the loss_fn already applies global normalizers."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, pg_collection=pg_collection, **kwargs)


def use_distributed_optimizer(optim_cfg: OptimConfig, device: torch.device) -> bool:
    """``optim.distributed_optimizer``: ``auto`` is on with CUDA and off on CPU; ``on`` runs
    megatron's DistributedOptimizer on either device (the CPU suite trains with it)."""
    if optim_cfg.distributed_optimizer == "auto":
        return device.type == "cuda"
    return optim_cfg.distributed_optimizer == "on"


def use_fused_adam(optim_cfg: OptimConfig, device: torch.device) -> bool:
    """``optim.fused_adam``: ``auto`` is on with CUDA and off on CPU (the CPU suite's golden
    numbers are torch's per-parameter loop's); ``on`` runs torch's fused kernel on either."""
    if optim_cfg.fused_adam == "auto":
        return device.type == "cuda"
    return optim_cfg.fused_adam == "on"


def torch_adams(optimizer: Any) -> list[torch.optim.Adam]:
    """The torch Adam/AdamW inside megatron's (chained) optimizer; none where megatron runs
    Transformer-Engine's or Apex's FusedAdam (not torch.optim.Adam subclasses)."""
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    inners = [getattr(sub, "optimizer", None) for sub in subs]
    return [o for o in inners if isinstance(o, torch.optim.Adam)]


def set_fused_adam(optimizer: Any, fused: bool) -> bool:
    """Make the torch AdamW that megatron's ``optimizer`` steps its fp32 main params with run
    fused (``fused=True``) or as megatron built it (``fused=None``: torch's default, foreach
    on CUDA, a loop on CPU; ``False`` would also turn foreach off). True when torch's fused
    kernel is now in use.

    megatron-core 0.19.2 builds ``torch.optim.AdamW(params, lr, weight_decay, betas, eps,
    capturable)`` with no fused argument and no hook to pass one (optimizer/__init__.py
    ``_get_megatron_optimizer_based_on_param_groups``). torch reads ``fused`` from each param
    group at every step (torch/optim/adam.py ``Adam.step``), so setting the group flag is
    what ``fused=True`` at construction does, less ``_step_supports_amp_scaling``, which only
    torch's GradScaler reads (megatron scales the loss itself). Also called after a
    checkpoint load: torch's ``load_state_dict`` takes the saved groups' flags. The ``step``
    counters follow torch's placement (adam.py ``_init_group``): on the parameter's device
    when fused, on the host otherwise; their values are kept."""
    flag = True if fused else None
    adams = torch_adams(optimizer)
    for inner in adams:
        inner.defaults["fused"] = flag
        for group in inner.param_groups:
            group["fused"] = flag
            for p in group["params"]:
                step = inner.state.get(p, {}).get("step")
                if torch.is_tensor(step):
                    where = p.device if fused else torch.device("cpu")
                    inner.state[p]["step"] = step.to(device=where, dtype=torch.float32)
    return fused and bool(adams)


@dataclass
class TrainingParts:
    """What a trainable policy steps with."""

    chunks: list[Any]
    """The model chunks wrapped in megatron's DistributedDataParallel (one per virtual stage)."""
    optimizer: Any
    """megatron's (chained) optimizer over ``chunks``."""
    distributed_optimizer: bool
    """Whether ``optimizer`` is megatron's DistributedOptimizer."""
    scheduler: LRSchedule
    """The LR schedule that sets ``optimizer``'s rate."""
    fused_adam: bool = False
    """Whether ``optimizer`` steps with torch's fused AdamW (``set_fused_adam``); the
    checkpoint load applies it again."""


def _wrap_ddp(models: list[Any], config: Any, ctx: ParallelContext, dist_opt: bool) -> list[Any]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=dist_opt,
        overlap_grad_reduce=False,
        # NaN/inf gradients are detected by train_step and skip the step instead of
        # raising inside the all-reduce.
        check_for_nan_in_grad=False,
    )
    return [
        DistributedDataParallel(
            config, ddp_cfg, m, disable_bucketing=i > 0, pg_collection=ctx.pg_collection
        )
        for i, m in enumerate(models)
    ]


def _build_optimizer(
    chunks: list[Any], config: Any, ctx: ParallelContext, optim_cfg: OptimConfig, dist_opt: bool
) -> Any:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    dtype = config.params_dtype
    opt_cfg = OptimizerConfig(
        optimizer="adam",
        lr=optim_cfg.lr,
        min_lr=optim_cfg.min_lr,
        weight_decay=optim_cfg.weight_decay,
        adam_beta1=optim_cfg.adam_beta1,
        adam_beta2=optim_cfg.adam_beta2,
        adam_eps=optim_cfg.adam_eps,
        clip_grad=optim_cfg.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=dist_opt,
    )
    # One rule for the optimizer's groups: megatron's own (pg_collection), no extra gloo
    # groups. megatron refuses gloo groups together with a pg_collection
    # (process_groups_config.py, setup_process_groups_for_optimizer), and none is needed:
    # every group of a run is created "cpu:gloo,cuda:nccl" (distributed/setup.py
    # process_group_backend), so CPU-side collectives already have a gloo backend.
    return get_megatron_optimizer(
        opt_cfg, chunks, use_gloo_process_groups=False, pg_collection=ctx.pg_collection
    )


def _foreach_l2_norm(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: list[list[torch.Tensor]],
    per_tensor: bool,
    *args: Any,
) -> tuple[torch.Tensor, None]:
    """megatron's ``local_multi_tensor_l2_norm`` (megatron/core/utils.py, its fallback without
    Apex/TE) without the host: that one reads every parameter's norm back
    (``torch.tensor(list of norms)``, a sync per parameter on a GPU) and the total once more;
    here the norms stay on the device (``torch._foreach_norm``: one fused kernel on CUDA).
    Same numbers: the per-tensor norms, then the 2-norm of their vector, in fp32."""
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def _foreach_scale(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], scale: float
) -> None:
    """megatron's ``local_multi_tensor_scale`` (``dst.copy_(src * scale)`` per tensor) as
    one foreach call."""
    src, dst = tensor_lists
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def use_foreach_grad_norm() -> bool:
    """Where megatron runs its local multi-tensor fallbacks (no Apex or TE), swap in the
    foreach versions above for the gradient norm and clipping (optimizer/clip_grads.py reads
    ``l2_norm_impl`` and ``multi_tensor_scale_impl`` at call time). The plain optimizers and
    the DistributedOptimizer alike reach them: ``get_grad_norm`` (MegatronOptimizer's,
    inherited by all three) calls ``get_grad_norm_fp32``, and ``clip_gradients`` below calls
    ``clip_grad_by_total_norm_fp32``. Idempotent; False when megatron uses Apex's or TE's
    kernels (nothing to do)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    swaps = {
        "l2_norm_impl": (getattr(utils, "local_multi_tensor_l2_norm", None), _foreach_l2_norm),
        "multi_tensor_scale_impl": (getattr(utils, "local_multi_tensor_scale", None), _foreach_scale),
    }  # fmt: skip
    done = False
    for name, (fallback, ours) in swaps.items():
        current = getattr(clip_grads, name, None)
        if current is ours or (fallback is not None and current is fallback):
            setattr(clip_grads, name, ours)
            done = True
    return done


def setup_training(
    models: list[Any], ctx: ParallelContext, optim_cfg: OptimConfig, total_steps: int
) -> TrainingParts:
    """Wrap ``models`` for training: DDP, the optimizer, and the LR schedule at step 0."""
    config = models[0].config
    use_foreach_grad_norm()
    dist_opt = use_distributed_optimizer(optim_cfg, ctx.device)
    chunks = _wrap_ddp(models, config, ctx, dist_opt)
    optimizer = _build_optimizer(chunks, config, ctx, optim_cfg, dist_opt)
    fused = set_fused_adam(optimizer, use_fused_adam(optim_cfg, ctx.device))
    # schedules.py backward_step applies grad_scale_func to the last stage's loss (loss
    # scaling for fp16; 1.0 for fp32/bf16).
    config.grad_scale_func = optimizer.scale_loss
    scheduler = LRSchedule(optim_cfg, total_steps, optimizer)
    return TrainingParts(chunks, optimizer, dist_opt, scheduler, fused)


def clip_gradients(optimizer: Any, clip: float, grad_norm: float) -> None:
    """Scale the gradients down to total norm ``clip`` (nothing when ``clip <= 0``), given
    their ``grad_norm`` from the optimizer."""
    # Resolved at call time so the CPU platform's replacement applies
    # (megatron/core/optimizer/clip_grads.py asserts CUDA grads).
    from megatron.core.optimizer import clip_grads

    if clip <= 0:
        return
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(sub, "is_stub_optimizer", False):
            continue
        params = sub.get_parameters()
        if params:
            clip_grads.clip_grad_by_total_norm_fp32(params, clip, grad_norm)
