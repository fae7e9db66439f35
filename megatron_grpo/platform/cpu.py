"""The CPU compatibility layer: run megatron-core (0.16.1 .. 0.19.2) on a machine without CUDA.

Design: docs/cpu-platform.md, "What the compatibility layer patches (platform/cpu.py)".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from packaging.version import Version
from torch.overrides import TorchFunctionMode

from megatron_grpo.platform.versions import check_megatron_core


@dataclass(frozen=True)
class Patch:
    """One redirected call: what is replaced, and which megatron-core file needs it."""

    target: str
    """Dotted name of the replaced attribute, e.g. ``torch.cuda.current_device``."""
    answers: str
    """The megatron-core file (and construct) that calls it on every CPU run."""
    since: str | None = None
    """The first megatron-core release that makes the call; None: every tested release."""


# megatron-core 0.19.0 added the wait on the current stream to start_grad_sync.
CURRENT_STREAM_SINCE = "0.19.0"

PATCHES: tuple[Patch, ...] = (
    Patch(
        "torch.cuda.current_device",
        "tensor_parallel/layers.py, mappings.py, pipeline_parallel/p2p_communication.py, "
        "distributed/param_and_grad_buffer.py: `device=torch.cuda.current_device()` in every "
        "buffer allocation, including inside autograd backward functions (mappings.py "
        "_reduce_scatter_along_first_dim), where no TorchFunctionMode is active. Returns "
        "torch.device('cpu') so those calls need no rewriting.",
    ),
    Patch(
        "torch.cuda.synchronize",
        "pipeline_parallel/p2p_communication.py (after batched isend/irecv), "
        "distributed/distributed_data_parallel.py: CPU ops are synchronous, so a no-op.",
    ),
    Patch(
        "torch.cuda.current_stream",
        "distributed/param_and_grad_buffer.py _ParamAndGradBucketGroup.start_grad_sync: "
        "`torch.cuda.current_stream().wait_event(...)` on every grad sync (for CUDA-graph "
        "replays): answered by torch.cpu.current_stream(), whose wait_event / wait_stream are "
        "no-ops (CPU ops are synchronous). megatron-core 0.16.1 .. 0.18.2 never call it.",
        since=CURRENT_STREAM_SINCE,
    ),
    Patch(
        "torch.cuda.Stream",
        "transformer/moe/token_dispatcher.py MoEAlltoAllTokenDispatcher: `__init__` creates "
        "`torch.cuda.Stream()` for its device-to-host copies of the split sizes (fails "
        "'CUDA driver version is insufficient' on CPU), and `_maybe_dtoh_and_synchronize` "
        "records an event on it and later `synchronize()`s it, on every MoE layer's dispatch "
        "(MoE models only). Answered by a torch.cpu stream whose `record_event` returns a "
        "`torch.cpu.Event` (no-ops: CPU ops are synchronous). `torch.cuda.stream(...)` around "
        "the copies needs no patch: its context is a no-op without a CUDA device index.",
    ),
    Patch(
        "token_dispatcher.maybe_move_tensor_to_cpu",
        "transformer/moe/token_dispatcher.py MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize "
        "(from transformer/moe/moe_utils.py): turns the alltoall's split sizes into numpy arrays "
        "only when they are CUDA tensors; on CPU they stay tensors, which "
        "ProcessGroup.all_to_all_single (tensor_parallel/mappings.py _AllToAll) refuses "
        "('incompatible function arguments'). The replacement copies a CPU tensor to numpy "
        "as the GPU path does (MoE models with expert parallelism only).",
    ),
    Patch(
        "torch.cuda.get_rng_state / set_rng_state / manual_seed",
        "tensor_parallel/random.py CudaRNGStatesTracker.add and model_parallel_cuda_manual_seed: "
        "the CUDA generator is the CPU default generator.",
    ),
    Patch(
        "megatron.core.tensor_parallel.random._get_cuda_rng_state / _set_cuda_rng_state",
        "tensor_parallel/random.py CudaRNGStatesTracker.fork and checkpointing: they index "
        "torch.cuda.default_generators directly; redirected to the CPU generator.",
    ),
    Patch(
        "torch.Tensor.cuda / torch.nn.Module.cuda",
        "models/common/language_module, transformer/module.py and callers that move modules or "
        "tensors with `.cuda()`: return the CPU object unchanged.",
    ),
    Patch(
        "factory calls with device='cuda' (TorchFunctionMode)",
        "every `torch.empty/zeros/tensor/...(device='cuda' | torch.cuda.current_device())` and "
        "`Tensor.to('cuda')` (optimizer/clip_grads.py, optimizer/optimizer.py, "
        "models/gpt/gpt_model.py, ...): the device argument is rewritten to 'cpu'.",
    ),
    Patch(
        "torch.Tensor.type() without arguments (TorchFunctionMode)",
        "optimizer/optimizer.py Float16OptimizerWithFloat16Params.__init__ and "
        "optimizer/distrib_optimizer.py _build_model_and_main_param_groups file each parameter "
        "by `param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']` / "
        "`== 'torch.cuda.FloatTensor'` and raise on anything else: a CPU tensor answers with "
        "the CUDA type name of its dtype ('torch.FloatTensor' -> 'torch.cuda.FloatTensor'), so "
        "bf16 params with fp32 main params and the distributed optimizer build on CPU. It also "
        "answers optimizer/clip_grads.py clip_grad_by_total_norm_fp32's "
        "`assert param.grad.type() == 'torch.cuda.FloatTensor'`.",
    ),
)

_state: dict[str, Any] = {"applied": False, "mode": None}


def _is_cuda_device(device: Any) -> bool:
    """True for every way megatron names the CUDA device: 'cuda', 'cuda:0', device('cuda'), 0."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    # A bare int is a CUDA ordinal (torch.cuda.current_device() returns 0 after patching).
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToCpuDeviceMode(TorchFunctionMode):
    """Rewrites a CUDA ``device`` argument of any torch call to ``'cpu'``.

    Catches factory functions (``torch.empty(..., device='cuda')``, ``device=0``) and
    ``Tensor.to('cuda')`` wherever megatron-core makes them, without patching each call site.
    Only device arguments change, and ``Tensor.type()`` (no argument) names a CPU tensor's
    type the way it would name it on the CUDA device; everything else passes through.

    Limitation (torch semantics): a mode is switched off while its own ``__torch_function__``
    runs, so calls made *inside* an intercepted call -- notably everything autograd runs
    under ``torch.autograd.backward`` -- are not rewritten. megatron's backward functions
    allocate with ``device=torch.cuda.current_device()``, which the current_device patch
    answers directly.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            # Tensor.to(device, ...) with a positional device, e.g. t.to(0) or t.to("cuda").
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # t.type() names the tensor's type; megatron's optimizers compare it with the
            # CUDA names (see PATCHES). t.type(dtype) converts and passes through unchanged.
            name = func(*args)
            return (
                name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
            )
        return func(*args, **kwargs)


def _cpu_get_cuda_rng_state(
    device: int | str | torch.device = "cuda", clone: bool = False, graph_safe: bool = False
) -> torch.Tensor:
    # Replaces megatron/core/tensor_parallel/random.py::_get_cuda_rng_state.
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_cuda_rng_state(
    new_state: torch.Tensor, device: int = -1, graph_safe: bool = False
) -> None:
    # Replaces megatron/core/tensor_parallel/random.py::_set_cuda_rng_state.
    torch.set_rng_state(new_state)


def _cpu_current_device() -> torch.device:
    # megatron only passes the result on as a device argument (see PATCHES); an int would
    # mean "cuda:<n>" to every factory function.
    return torch.device("cpu")


def _cpu_current_stream(device: Any = None) -> torch.cpu.Stream:
    return torch.cpu.current_stream()


class _CpuStream(torch.cpu.Stream):
    """``torch.cuda.Stream(...)`` on CPU: takes CUDA's arguments; its events are CPU events."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        super().__init__(priority)

    # CUDA's signature (megatron calls it so), not torch.cpu.Stream's no-argument one.
    def record_event(self, event: Any = None) -> torch.cpu.Event:  # type: ignore[override]
        return event if event is not None else torch.cpu.Event()


def _cpu_maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False):
    # Replaces megatron/core/transformer/moe/moe_utils.py::maybe_move_tensor_to_cpu in the
    # token dispatcher: the GPU path's device-to-host copy (and numpy view) of a CPU tensor.
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.detach().clone().numpy()
    return tensor


def _cuda_rng_get(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _cuda_rng_set(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.set_rng_state(new_state)


def _cuda_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _tensor_cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **_: Any):
    return self


def _module_cuda(self: torch.nn.Module, device: Any = None) -> torch.nn.Module:
    return self


@contextlib.contextmanager
def device_mode_suspended() -> Iterator[None]:
    """Run a block without ``CudaToCpuDeviceMode`` (a no-op where it is not active).

    For hot paths that never name a device (the weight sync): with the mode on, every
    torch call there pays a Python ``__torch_function__`` round trip (~640 per sync of the
    tiny model, a few ms)."""
    mode = _state.get("mode")
    stack = torch.overrides._get_current_function_mode_stack()
    if mode is None or not stack or stack[-1] is not mode:
        yield
        return
    with torch.overrides._pop_mode_temporarily():
        yield


def is_applied() -> bool:
    """Whether ``apply_cpu_platform`` has patched this process."""
    return bool(_state["applied"])


def apply_cpu_platform() -> bool:
    """Redirect megatron-core's CUDA-only calls to the CPU, once per process.

    Returns True when the layer is active (applied now or earlier), False when CUDA is
    available (nothing is patched then). Raises ``VersionError`` when the installed
    megatron-core is outside the tested range the patches were written against.
    """
    if torch.cuda.is_available():
        return False
    if _state["applied"]:
        return True
    installed = Version(check_megatron_core())  # a local suffix (+cpu) compares as the release

    import megatron.core.tensor_parallel.random as tp_random
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    # The patch replaces CUDA functions, classes and methods with CPU stand-ins whose types
    # differ from torch's on purpose (a CPU device, a CPU stream): mypy is told so per line.
    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None
    if installed >= Version(CURRENT_STREAM_SINCE):
        torch.cuda.current_stream = _cpu_current_stream  # type: ignore[assignment]
    torch.cuda.Stream = _CpuStream  # type: ignore[misc, assignment]
    torch.cuda.get_rng_state = _cuda_rng_get
    torch.cuda.set_rng_state = _cuda_rng_set
    torch.cuda.manual_seed = _cuda_manual_seed
    torch.cuda.random.get_rng_state = _cuda_rng_get
    torch.cuda.random.set_rng_state = _cuda_rng_set
    tp_random._get_cuda_rng_state = _cpu_get_cuda_rng_state
    tp_random._set_cuda_rng_state = _cpu_set_cuda_rng_state
    token_dispatcher.maybe_move_tensor_to_cpu = _cpu_maybe_move_tensor_to_cpu
    torch.Tensor.cuda = _tensor_cuda  # type: ignore[method-assign, assignment]
    torch.nn.Module.cuda = _module_cuda  # type: ignore[method-assign, assignment]

    mode = CudaToCpuDeviceMode()
    # Entered for the rest of the process: the mode stack is process state like the patches.
    mode.__enter__()
    _state["mode"] = mode
    _state["applied"] = True
    return True
