"""Counting what a step asks of the device: the ATen ops it dispatches and the calls that
make the host wait for the device (``bench ops``; tests/bench/test_op_budget.py holds them).

Counts are deterministic where timings are not, and the same on a CPU as on a GPU for the
same code path, so a CPU test can notice a dependency bump that makes the GPU step launch
three times the kernels (docs/benchmarks.md, "bench ops").

- ``OpCounter`` (a ``TorchDispatchMode``): every ATen op below autograd, forward and
  backward, by name and by source site (the innermost frame of the project or megatron-core
  in forward; ``backward: <autograd node>`` in backward).
- ``SyncCounter`` (a ``TorchFunctionMode``): the calls that block the host on a GPU, by
  site: ``tolist``, ``item``, ``bool``/``int``/``float`` of a tensor, ``cpu``/``numpy``,
  ``torch.equal``, ``nonzero``, a blocking ``to(device)`` and ``torch.tensor`` of tensors.
  On a CPU nothing waits; the count is of the calls that would.
- ``count_flops``: the FLOPs of a call (``torch.utils.flop_counter.FlopCounterMode``, with
  formulas for the project's varlen attention ops).
- ``SavedBytes``: the bytes autograd keeps for the backward pass (saved-tensors hooks).
"""

from __future__ import annotations

import collections
import os
import sys
from dataclasses import dataclass, field
from types import FrameType

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_OWN_ROOTS = tuple(
    os.path.dirname(os.path.dirname(str(m.__file__))) + os.sep
    for m in (sys.modules[__name__.split(".")[0]],)  # a regular package: __file__ is set
)
_TORCH_ROOT = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = __file__
_MODE_HANDLERS = ("__torch_function__", "__torch_dispatch__")
"""Frames of other modes (the CPU platform layer's device rewriting) are not sites."""


def _site(depth: int = 2) -> str:
    """``file:line function`` of the innermost frame outside torch and this module: the
    line of the project or a library that made the call."""
    frame: FrameType | None = sys._getframe(depth)
    while frame is not None:
        name = frame.f_code.co_filename
        if (
            not name.startswith(_TORCH_ROOT)
            and name != _THIS_FILE
            and frame.f_code.co_name not in _MODE_HANDLERS
        ):
            return f"{short_path(name)}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "<torch>"


def short_path(path: str) -> str:
    """A site's file relative to its package root (``megatron/core/...``,
    ``megatron_grpo/...``)."""
    for marker in ("site-packages" + os.sep, *_OWN_ROOTS):
        i = path.find(marker)
        if i >= 0:
            return path[i + len(marker) :] if marker.endswith(os.sep) else path
    return path


@dataclass
class Counts:
    """What one counter saw: totals by name and by site."""

    by_name: collections.Counter = field(default_factory=collections.Counter)
    by_site: collections.Counter = field(default_factory=collections.Counter)

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    def top(self, what: str = "by_name", n: int = 10) -> list[tuple[str, int]]:
        return getattr(self, what).most_common(n)

    def to_dict(self, n: int = 20) -> dict:
        return {
            "total": self.total,
            "by_name": dict(self.top("by_name", n)),
            "by_site": dict(self.top("by_site", n)),
        }


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched inside the block (``counts``)."""

    def __init__(self, sites: bool = True) -> None:
        super().__init__()
        self.counts = Counts()
        self.sites = sites

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts.by_name[name] += 1
        if self.sites:
            node = torch._C._current_autograd_node()
            site = f"backward: {node.name()}" if node is not None else _site()
            self.counts.by_site[site] += 1
        return func(*args, **(kwargs or {}))


def _blocking_to(args, kwargs) -> bool:
    """Whether ``Tensor.to(...)`` names a device and may block (not ``non_blocking=True``).
    A CUDA tensor sent to its own device is no copy (``to`` returns it): not counted. A CPU
    tensor sent to the CPU is counted: on a GPU the same line copies to the device."""
    if kwargs.get("non_blocking"):
        return False
    target = kwargs.get("device")
    if target is None:
        target = next((a for a in args[1:] if isinstance(a, (torch.device, str))), None)
        if target is None or (len(args) > 2 and args[2] is True):  # to(device, dtype, nb)
            return False
    src, dst = args[0], torch.device(target)
    same_cuda = src.is_cuda and dst.type == "cuda" and dst.index in (None, src.device.index)
    return not same_cuda


_SYNC_METHODS = {
    torch.Tensor.tolist: "tolist",
    torch.Tensor.item: "item",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float",
    torch.Tensor.__index__: "index",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.nonzero: "nonzero",
    torch.nonzero: "nonzero",
    torch.equal: "equal",
}


class SyncCounter(TorchFunctionMode):
    """Counts the host-sync-prone calls made inside the block (``counts``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = Counts()

    def _note(self, name: str, n: int = 1) -> None:
        self.counts.by_name[name] += n
        self.counts.by_site[f"{name} @ {_site(3)}"] += n

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _SYNC_METHODS.get(func)
        if name is not None and not _optimizer_step_counter(name):
            self._note(name)
        elif func is torch.Tensor.to and _blocking_to(args, kwargs):
            self._note("to(device)")
        elif func is torch.tensor and args and isinstance(args[0], (list, tuple)):
            n = _tensors_in(args[0])
            if n:
                self._note("tensor(list of tensors)", n)  # one read per tensor
        return func(*args, **kwargs)


def _optimizer_step_counter(name: str) -> bool:
    """``item`` of torch.optim's per-parameter ``step`` counter: a CPU tensor even on a GPU
    (unless the optimizer is fused or capturable), so reading it never waits on the device."""
    if name != "item":
        return False
    frame: FrameType | None = sys._getframe(3)
    while frame is not None and frame.f_code.co_name in _MODE_HANDLERS + ("_note",):
        frame = frame.f_back
    return frame is not None and f"torch{os.sep}optim{os.sep}" in frame.f_code.co_filename


def _tensors_in(data) -> int:
    """Tensors in a (nested) list: ``torch.tensor`` reads each one to the host."""
    if isinstance(data, torch.Tensor):
        return 1
    return sum(_tensors_in(x) for x in data) if isinstance(data, (list, tuple)) else 0


def _varlen_flops(q_shape, bounds: list[int], factor: int) -> int:
    """``factor`` matrix products of causal attention over each document of ``bounds``,
    half of each ``n x n`` square (the convention of ``bench.train.measure``)."""
    _, heads, dim = q_shape
    return sum(factor * heads * dim * (b - a) ** 2 for a, b in zip(bounds, bounds[1:]))


_FLOP_FORMULAS: dict = {}


def _flop_formulas() -> dict:
    """FlopCounterMode's formulas for the project's varlen attention custom ops (one op per
    layer, opaque to the counter): forward 2 products (scores, weighted sum), backward 5
    (scores recomputed, then 4), as torch counts SDPA's."""
    if not _FLOP_FORMULAS:
        import megatron_grpo.policy.attention  # noqa: F401  (registers the ops)

        def forward(q, k, v, bounds, scale, *, out_shape=None, **_) -> int:
            return _varlen_flops(q, bounds, 2)

        def backward(grad, q, k, v, out, lse, bounds, scale, *, out_shape=None, **_) -> int:
            return _varlen_flops(q, bounds, 5)

        from torch.utils.flop_counter import register_flop_formula

        ops = torch.ops.megatron_grpo
        for op, f in ((ops.varlen_attention, forward), (ops.varlen_attention_backward, backward)):
            _FLOP_FORMULAS[op] = register_flop_formula(op)(f)
    return _FLOP_FORMULAS


def count_flops(fn) -> int:
    """The FLOPs of one call of ``fn`` (matrix products and attention, as FlopCounterMode
    counts them; elementwise work is not counted)."""
    from torch.utils.flop_counter import FlopCounterMode

    _flop_formulas()
    with FlopCounterMode(display=False) as mode:
        fn()
    return int(mode.get_total_flops())


class SavedBytes:
    """The bytes of the tensors autograd saves for the backward pass inside the block
    (``bytes``), through ``torch.autograd.graph.saved_tensors_hooks``: each storage once (a
    view keeps its whole storage alive), the parameters' storages (``params``) not at all,
    only what the forward saves (not what a recomputing backward saves and frees again).
    The saved tensors are held until the block ends, so that a storage freed by one
    micro-batch's backward and reused by the next is counted again."""

    def __init__(self, params) -> None:
        self.exclude = {p.untyped_storage().data_ptr() for p in params}
        self.bytes = 0
        self._held: dict[int, torch.Tensor] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if torch._C._current_autograd_node() is None and t.device.type != "meta":
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self.exclude and ptr not in self._held:
                self._held[ptr] = t
                self.bytes += storage.nbytes()
        return t

    def __enter__(self) -> SavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._held.clear()
