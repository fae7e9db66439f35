"""Training setup of a policy's model chunks: megatron's DDP wrappers, its optimizer (plain
or distributed), the LR schedule that drives it, and gradient clipping.

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


def finalize_grads_without_token_scaling(model, num_tokens, pg_collection=None, **kwargs):
    """megatron's finalize_model_grads (DP all-reduce, tied-embedding all-reduce across PP
    stages) with ``num_tokens=None``: the loss_fn already applies global normalizers."""
    from megatron.core.distributed import finalize_model_grads

    return finalize_model_grads(model, None, pg_collection=pg_collection, **kwargs)


def use_distributed_optimizer(optim_cfg: OptimConfig, device: torch.device) -> bool:
    """``optim.distributed_optimizer``: ``auto`` is on with CUDA and off on CPU; ``on`` runs
    megatron's DistributedOptimizer on either device (the CPU suite trains with it)."""
    if optim_cfg.distributed_optimizer == "auto":
        return device.type == "cuda"
    return optim_cfg.distributed_optimizer == "on"


@dataclass
class TrainingParts:
    """What a trainable policy steps with."""

    chunks: list
    """The model chunks wrapped in megatron's DistributedDataParallel (one per virtual stage)."""
    optimizer: Any
    """megatron's (chained) optimizer over ``chunks``."""
    distributed_optimizer: bool
    """Whether ``optimizer`` is megatron's DistributedOptimizer."""
    scheduler: LRSchedule
    """The LR schedule that sets ``optimizer``'s rate."""


def _wrap_ddp(models: list, config, ctx: ParallelContext, dist_opt: bool) -> list:
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


def _build_optimizer(chunks: list, config, ctx: ParallelContext, optim_cfg: OptimConfig,
                     dist_opt: bool):  # fmt: skip
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


def _foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron's ``local_multi_tensor_l2_norm`` (megatron/core/utils.py, its fallback without
    Apex/TE) without the host: that one reads every parameter's norm back
    (``torch.tensor(list of norms)``, a sync per parameter on a GPU) and the total once more;
    here the norms stay on the device (``torch._foreach_norm``: one fused kernel on CUDA).
    Same numbers: the per-tensor norms, then the 2-norm of their vector, in fp32."""
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def _foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
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
    ``l2_norm_impl`` and ``multi_tensor_scale_impl`` at call time). Idempotent; False when
    megatron uses Apex's or TE's kernels (nothing to do)."""
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
    models: list, ctx: ParallelContext, optim_cfg: OptimConfig, total_steps: int
) -> TrainingParts:
    """Wrap ``models`` for training: DDP, the optimizer, and the LR schedule at step 0."""
    config = models[0].config
    use_foreach_grad_norm()
    dist_opt = use_distributed_optimizer(optim_cfg, ctx.device)
    chunks = _wrap_ddp(models, config, ctx, dist_opt)
    optimizer = _build_optimizer(chunks, config, ctx, optim_cfg, dist_opt)
    # schedules.py backward_step applies grad_scale_func to the last stage's loss (loss
    # scaling for fp16; 1.0 for fp32/bf16).
    config.grad_scale_func = optimizer.scale_loss
    scheduler = LRSchedule(optim_cfg, total_steps, optimizer)
    return TrainingParts(chunks, optimizer, dist_opt, scheduler)


def clip_gradients(optimizer, clip: float, grad_norm: float) -> None:
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
