"""NCCL's rules, emulated over gloo, so the CPU suite catches what a first GPU run would hit.

Gloo forgives two faults that NCCL does not (docs/launch.md "NCCL rules"):

1. **Devices.** A group created with backend ``nccl`` serves CUDA tensors only; a CPU tensor
   in a collective raises. ``install(gpu_backend=...)`` records, for every group, the
   backend it would have on a GPU run (the default group: ``gpu_backend``, by default what
   ``distributed.setup.process_group_backend("nccl")`` returns; ``new_group`` without a
   backend inherits it; an explicit ``backend="gloo"`` stays gloo) and makes every tensor
   collective called through ``torch.distributed`` raise ``NcclRuleError`` when a tensor's
   device type is not among the ones that backend serves. All tensors are CPU tensors
   here, so this catches CPU tensors on NCCL-only groups; the mirror fault (a CUDA tensor
   on a gloo-only group) cannot be emulated on CPU.
2. **Point-to-point order.** NCCL runs the send/recv operations between two ranks on one
   stream in issue order: an ``isend``/``irecv`` to peer ``p`` starts only when every
   earlier operation this rank issued to ``p`` has completed; the operations of one
   ``batch_isend_irecv`` call are grouped and wait only for what came before the batch.
   And ``Work.wait()`` without a timeout returns once the operation is *enqueued*, not
   done (the CPU then races the stream); ``Work.wait(timeout)`` blocks until done or
   raises after ``timeout``. The emulation does exactly this: every ``isend``/``irecv``
   returns at once with an emulated ``Work``; a helper thread posts the real gloo
   operation once the peer's earlier operations completed.

Not emulated: a CUDA tensor on a gloo-only group, ranks that pass tensors on different
devices to the same collective (with ``cpu:gloo,cuda:nccl`` each rank would dispatch to
another backend and hang), NCCL's communicator set-up rules for ``batch_isend_irecv``, and
anything about speed.

``torch.cuda.synchronize()`` is the other bound NCCL code uses (megatron's
``_communicate_shapes`` waits, then synchronizes): under the emulation it blocks until every
operation issued so far has completed.

On a GPU, a tensor received after a plain ``wait()`` is still correct for GPU work that
consumes it (stream-ordered); only a CPU read is unbounded. Here every tensor is a CPU
tensor, so a read after a plain ``wait()`` sees stale data: code that must bound its waits
(the bridge) fails as it should, but megatron's pipeline schedule, which hands received
activations straight to the forward pass, would fail falsely. For such code set
``MEGATRON_GRPO_NCCL_RULES_WAIT=done``: a plain ``wait()`` then blocks, without bound, until
the operation is done (the ordering rule still applies; a deadlock then hangs until the
test's timeout, as it would hang on NCCL).

Install it inside a spawned rank before any traffic (``maybe_install()`` does so when the
environment variable ``MEGATRON_GRPO_NCCL_RULES`` is set: ``1`` for the project's GPU
backend, or a backend string such as ``nccl`` to emulate that one instead); the test
helpers ``tests/dist_utils.py`` and ``tests/bridge/test_transport.py`` call it in every rank.
"""

from __future__ import annotations

import inspect
import os
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

ENV = "MEGATRON_GRPO_NCCL_RULES"
WAIT_ENV = "MEGATRON_GRPO_NCCL_RULES_WAIT"


class NcclRuleError(RuntimeError):
    """An operation that NCCL would refuse (or that would deadlock under NCCL)."""


_ORIG: dict[str, Any] = {}
_GPU_BACKEND: dict[int, str] = {}  # id(group) -> backend the group would have on GPU
_DEFAULT: list[str] = []
_LOCK = threading.Lock()
_TAILS: dict[tuple[int, int], threading.Event] = {}  # (id(group), peer) -> last op done
_ISSUED: list[threading.Event] = []  # every op's completion, for torch.cuda.synchronize
_WAIT_DONE: list[bool] = [False]  # plain wait() blocks until done (MEGATRON_GRPO_NCCL_RULES_WAIT)


def served_devices(backend: str) -> set[str]:
    """Device types a backend string serves: ``nccl`` -> cuda, ``gloo`` -> cpu and cuda
    (gloo copies CUDA tensors through the host), ``cpu:gloo,cuda:nccl`` -> both."""
    out: set[str] = set()
    for part in backend.lower().split(","):
        if ":" in part:
            out.add(part.split(":")[0].strip())
        elif part.strip() == "nccl":
            out.add("cuda")
        else:
            out |= {"cpu", "cuda"}
    return out


def _gpu_backend_of(group: Any) -> str:
    if group is None or group is dist.GroupMember.WORLD:
        return _DEFAULT[0]
    return _GPU_BACKEND.get(id(group), _DEFAULT[0])


def _check_devices(name: str, group: Any, tensors: list) -> None:
    backend = _gpu_backend_of(group)
    served = served_devices(backend)
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type not in served:
            raise NcclRuleError(
                f"NCCL rule: torch.distributed.{name} got a {t.device.type} tensor "
                f"{tuple(t.shape)} on a group that would be '{backend}' on GPU, which serves "
                f"{sorted(served)} tensors only: create the groups as 'cpu:gloo,cuda:nccl' "
                "(distributed.setup.process_group_backend) or move the tensor to ctx.device."
            )


def _tensors(args: tuple, kwargs: dict) -> list:
    out = []
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += [x for x in a if isinstance(x, torch.Tensor)]
    return out


def _wrap_collective(name: str) -> Any:
    orig = getattr(dist, name)
    sig = inspect.signature(orig)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        group = sig.bind_partial(*args, **kwargs).arguments.get("group")
        _check_devices(name, group, _tensors(args, kwargs))
        return orig(*args, **kwargs)

    wrapper.__name__ = name
    return wrapper


# ---------------------------------------------------------------------- point to point
class EmulatedWork:
    """A ``Work`` with NCCL's waiting semantics (see the module docstring)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.done = threading.Event()
        self.exc: BaseException | None = None

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is None or timeout.total_seconds() <= 0:
            if not _WAIT_DONE[0]:
                return True  # NCCL: enqueued on the stream, not done
            self.done.wait()
            if self.exc is not None:
                raise self.exc
            return True
        if not self.done.wait(timeout.total_seconds()):
            raise NcclRuleError(
                f"NCCL-rules emulation: {self.what} did not complete within "
                f"{timeout.total_seconds():.1f}s (Work.wait timeout)"
            )
        if self.exc is not None:
            raise self.exc
        return True


def _post_after(kind: str, tensor: torch.Tensor, peer: int, group: Any, tag: int,
                after: list[threading.Event], work: EmulatedWork) -> None:  # fmt: skip
    orig = _ORIG["isend" if kind == "send" else "irecv"]
    _ISSUED.append(work.done)

    def run() -> None:
        for ev in after:
            ev.wait()
        try:
            if kind == "send":
                w = orig(tensor, dst=peer, group=group, tag=tag)
            else:
                w = orig(tensor, src=peer, group=group, tag=tag)
            w.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            work.exc = exc
        work.done.set()

    threading.Thread(target=run, daemon=True, name=f"nccl-rules-{kind}-{peer}").start()


def _p2p(kind: str, tensor: torch.Tensor, peer: int, group: Any, tag: int) -> EmulatedWork:
    _check_devices("isend" if kind == "send" else "irecv", group, [tensor])
    work = EmulatedWork(f"{kind} {'to' if kind == 'send' else 'from'} rank {peer} (tag {tag})")
    key = (id(group), peer)
    with _LOCK:
        prev = _TAILS.get(key)
        _TAILS[key] = work.done
    _post_after(kind, tensor, peer, group, tag, [prev] if prev else [], work)
    return work


def _global(peer: int | None, group: Any, group_peer: int | None) -> int:
    if peer is None and group_peer is not None:
        return group_peer if group is None else dist.get_global_rank(group, group_peer)
    return peer


def isend(tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0,
          group_dst: int | None = None) -> EmulatedWork:  # fmt: skip
    return _p2p("send", tensor, _global(dst, group, group_dst), group, tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0,
          group_src: int | None = None) -> EmulatedWork:  # fmt: skip
    return _p2p("recv", tensor, _global(src, group, group_src), group, tag)


def send(tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0,
         group_dst: int | None = None) -> None:  # fmt: skip
    isend(tensor, dst, group, tag, group_dst).wait(timedelta(days=1))


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0,
         group_src: int | None = None) -> int:  # fmt: skip
    irecv(tensor, src, group, tag, group_src).wait(timedelta(days=1))
    return _global(src, group, group_src)


def batch_isend_irecv(p2p_op_list: list) -> list[EmulatedWork]:
    """Grouped: each op waits only for the operations issued to its peer before the batch."""
    works = []
    with _LOCK:
        before = {}
        for op in p2p_op_list:
            key = (id(op.group), op.peer)
            before.setdefault(key, _TAILS.get(key))
        per_key: dict[tuple[int, int], list[threading.Event]] = {}
        for op in p2p_op_list:
            kind = "send" if op.op is isend else "recv"
            _check_devices("batch_isend_irecv", op.group, [op.tensor])
            work = EmulatedWork(f"batched {kind} with rank {op.peer} (tag {op.tag})")
            key = (id(op.group), op.peer)
            prev = before[key]
            _post_after(kind, op.tensor, op.peer, op.group, op.tag, [prev] if prev else [], work)
            per_key.setdefault(key, []).append(work.done)
            works.append(work)
        for key, events in per_key.items():
            tail = threading.Event()

            def join(events: list = events, tail: threading.Event = tail) -> None:
                for ev in events:
                    ev.wait()
                tail.set()

            threading.Thread(target=join, daemon=True).start()
            _TAILS[key] = tail
    return works


# ---------------------------------------------------------------------- groups
def _init_process_group(*args: Any, **kwargs: Any) -> Any:
    backend = kwargs.pop("backend", args[0] if args else None)
    args = args[1:]
    _DEFAULT[:] = [_DEFAULT_GPU[0] if backend in (None, "gloo") else str(backend)]
    return _ORIG["init_process_group"](*args, backend="gloo", **kwargs)


def _new_group(*args: Any, **kwargs: Any) -> Any:
    backend = kwargs.get("backend")
    if backend is not None and "nccl" in str(backend):
        kwargs["backend"] = "gloo"
    kwargs.pop("pg_options", None)  # NCCL options mean nothing to gloo
    group = _ORIG["new_group"](*args, **kwargs)
    _GPU_BACKEND[id(group)] = _DEFAULT[0] if backend is None else str(backend)
    return group


_DEFAULT_GPU: list[str] = []
_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "reduce", "all_to_all_single", "gather", "scatter",
)  # fmt: skip


def _synchronize(device: Any = None) -> None:
    """``torch.cuda.synchronize``: every operation issued so far has completed."""
    for ev in list(_ISSUED):
        ev.wait()
    _ISSUED.clear()
    _ORIG["synchronize"](device)


def install(gpu_backend: str | None = None) -> None:
    """Apply both rules in this process (idempotent). ``gpu_backend``: the default group's
    backend on a GPU run; None asks the project (``process_group_backend("nccl")``)."""
    if _ORIG:
        return
    if gpu_backend is None:
        from megatron_grpo.distributed.setup import process_group_backend

        gpu_backend = process_group_backend("nccl")
    _DEFAULT_GPU[:] = [gpu_backend]
    _DEFAULT[:] = [gpu_backend]
    for name in ("isend", "irecv", "send", "recv", "batch_isend_irecv", "init_process_group",
                 "new_group", *_COLLECTIVES):  # fmt: skip
        _ORIG[name] = getattr(dist, name)
    for name in _COLLECTIVES:
        setattr(dist, name, _wrap_collective(name))
    for name, fn in (("isend", isend), ("irecv", irecv), ("send", send), ("recv", recv),
                     ("batch_isend_irecv", batch_isend_irecv)):  # fmt: skip
        setattr(dist, name, fn)
    # P2POp checks its op against c10d's module globals.
    c10d.isend, c10d.irecv = isend, irecv
    dist.init_process_group = _init_process_group
    dist.new_group = _new_group
    c10d.new_group = _new_group  # megatron's create_group calls torch.distributed.new_group
    _WAIT_DONE[0] = os.environ.get(WAIT_ENV, "enqueue") == "done"
    _ORIG["synchronize"] = torch.cuda.synchronize
    torch.cuda.synchronize = _synchronize
    # The CPU platform layer (applied later, by init_distributed) sets its own no-op
    # torch.cuda.synchronize: put the emulated one back on top of it.
    import megatron_grpo.platform.cpu as platform_cpu

    apply = platform_cpu.apply_cpu_platform

    def apply_cpu_platform() -> bool:
        active = apply()
        if torch.cuda.synchronize is not _synchronize:
            _ORIG["synchronize"] = torch.cuda.synchronize
            torch.cuda.synchronize = _synchronize
        return active

    platform_cpu.apply_cpu_platform = apply_cpu_platform


def maybe_install() -> bool:
    """``install()`` when ``MEGATRON_GRPO_NCCL_RULES`` is set (``1`` or a backend string)."""
    value = os.environ.get(ENV, "")
    if not value or value == "0":
        return False
    install(None if value == "1" else value)
    return True
