"""Move a trainer's optimizer state, gradients and (optionally) weights off its device.

Design: docs/rollout.md, "What moves off the GPU, and how (policy/offload.py)".
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron_grpo.policy.policy import Policy


@dataclass(frozen=True)
class OffloadReport:
    bytes: int
    """Device bytes freed (offload) or re-allocated (reload)."""
    seconds: float
    waited_s: float = 0.0
    """Of ``seconds``, the time spent waiting for host buffers still being allocated ahead."""


class _HostPool:
    """Host buffers (flat uint8, pinned when ``pin``) by byte size: ``take`` one, ``give`` it
    back; ``reserve`` makes sizes ahead in a background thread (see the module doc)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: dict[int, list[torch.Tensor]] = {}
        self._pending: Counter[int] = Counter()  # sizes the thread has still to make
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self.reserve_s: float | None = None
        """Seconds the background allocation took, once it is done."""

    def _alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def reserve(self, sizes: list[int]) -> None:
        """Allocate buffers of ``sizes`` (bytes) ahead, in this order, in a daemon thread."""
        sizes = [n for n in sizes if n > 0]
        if not sizes:
            return
        with self._cv:
            self._pending.update(sizes)
        # The thread must allocate on this rank's device: a thread starts on device 0, and
        # pinning from there would open a CUDA context on GPU 0 for every rank.
        device = torch.cuda.current_device() if self.pin else None
        self._thread = threading.Thread(
            target=self._fill, args=(sizes, device), name="trainer-offload-host", daemon=True
        )
        self._thread.start()

    def _fill(self, sizes: list[int], device: int | None) -> None:
        t0 = time.perf_counter()
        try:
            if device is not None:
                torch.cuda.set_device(device)
            for n in sizes:
                with self._cv:
                    if self._pending[n] <= 0:  # trimmed meanwhile
                        continue
                buf = self._alloc(n)
                with self._cv:
                    if self._pending[n] > 0:
                        self._pending[n] -= 1
                        self._free.setdefault(n, []).append(buf)
                    self._cv.notify_all()
        except BaseException:  # noqa: BLE001 - take() allocates on the spot and raises there
            pass
        finally:
            with self._cv:
                self._pending.clear()
                self._cv.notify_all()
            self.reserve_s = time.perf_counter() - t0

    def take(self, nbytes: int) -> tuple[torch.Tensor, float]:
        """A buffer of ``nbytes``, and the seconds spent waiting for the thread to make it."""
        t0 = time.perf_counter()
        with self._cv:
            while not self._free.get(nbytes) and self._pending[nbytes] > 0:
                self._cv.wait(timeout=1.0)
            waited = time.perf_counter() - t0
            if self._free.get(nbytes):
                return self._free[nbytes].pop(), waited
        return self._alloc(nbytes), waited

    def give(self, buf: torch.Tensor) -> None:
        with self._cv:
            self._free.setdefault(buf.numel(), []).append(buf)

    def trim(self) -> None:
        """Free every buffer not taken, and make no more ahead."""
        with self._cv:
            self._free.clear()
            self._pending.clear()


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over ``t``'s whole storage."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))


class TrainerOffload:
    """``offload()`` / ``reload()`` of a trainable ``policy.Policy``'s state (see module doc).

    ``optimizer``: the optimizer state, fp32 masters and gradient buffers; ``params``: the
    model weights. The colocated loop holds one of each so that the weights can stay for
    the weight sync after the optimizer state has left (trainer/colocated_memory.py)."""

    def __init__(self, policy: Policy, optimizer: bool = True, params: bool = False) -> None:
        if not policy.trainable:
            raise ValueError("TrainerOffload needs a trainable Policy (built with optim_cfg).")
        self.policy = policy
        self.optimizer = optimizer
        self.params = params
        self.offloaded = False
        self._kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device tensor, host copy)
        self._dropped: list[tuple[torch.Tensor, int]] = []  # (device tensor, bytes)
        self._host = _HostPool(pin=torch.cuda.is_available())
        if self._host.pin:
            self._host.reserve(self._expected_host_bytes())

    # --------------------------------------------------------------------- collection
    def _model_tensors(self) -> list[torch.Tensor]:
        out = [p for m in self.policy.chunks for p in m.parameters()]
        for buf in self._ddp_buffers():
            if buf.param_data is not None:
                out.append(buf.param_data)
        return out

    def _ddp_buffers(self) -> list[Any]:
        return [
            b
            for m in self.policy.chunks
            for b in getattr(m, "buffers", []) + getattr(m, "expert_parallel_buffers", [])
        ]

    def _inner_optimizers(self) -> list[torch.optim.Optimizer]:
        opt = self.policy.optimizer
        out = []
        for sub in getattr(opt, "chained_optimizers", [opt]):
            inner = getattr(sub, "optimizer", None)
            if inner is not None and not getattr(sub, "is_stub_optimizer", False):
                out.append(inner)
        return out

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        out = []
        for inner in self._inner_optimizers():
            for state in inner.state.values():
                out += [v for v in state.values() if isinstance(v, torch.Tensor) and v.numel()]
            for group in inner.param_groups:
                out += list(group["params"])  # fp32 masters; model weights filtered out below
        return out

    def _stateless_params(self) -> list[torch.Tensor]:
        """Optimizer parameters without optimizer state yet (before the first step)."""
        return [
            p
            for inner in self._inner_optimizers()
            for group in inner.param_groups
            for p in group["params"]
            if not inner.state.get(p)
        ]

    def _collect(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(tensors copied to the host, gradient buffers dropped), one per storage."""
        model = self._unique(self._model_tensors(), set())
        model_ptrs = {t.untyped_storage().data_ptr() for t in model}
        grads, keep = [], []
        if self.optimizer:
            grads = self._unique([b.grad_data for b in self._ddp_buffers()], set())
            grad_ptrs = {t.untyped_storage().data_ptr() for t in grads}
            keep = self._unique(self._optimizer_tensors(), model_ptrs | grad_ptrs)
        if self.params:
            keep += model
        return keep, grads

    def _expected_host_bytes(self) -> list[int]:
        """The host buffers offloads will take: what exists now, then the optimizer state
        the first step creates (torch Adam: exp_avg, exp_avg_sq in the parameter's dtype
        and a float32 step, per parameter)."""
        keep, _ = self._collect()
        sizes = [t.untyped_storage().nbytes() for t in keep]
        if self.optimizer:
            for p in self._stateless_params():
                n = p.numel() * p.element_size()
                sizes += [n, n, 4]
        return sizes

    @staticmethod
    def _unique(tensors: Iterable[torch.Tensor], exclude: set[int]) -> list[torch.Tensor]:
        seen, out = set(exclude), []
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr and ptr not in seen:
                seen.add(ptr)
                out.append(t)
        return out

    # --------------------------------------------------------------------- moves
    def offload(self) -> OffloadReport:
        """Free the state from the device; a no-op (0 bytes) when already offloaded."""
        if self.offloaded:
            return OffloadReport(0, 0.0)
        t0 = time.perf_counter()
        keep, grads = self._collect()
        pin = self._host.pin
        waited = 0.0
        self._kept = []
        for t in keep:
            host, w = self._host.take(t.untyped_storage().nbytes())
            waited += w
            self._kept.append((t, host))
        for t, host in self._kept:
            host.copy_(_storage_bytes(t), non_blocking=pin)
        if pin:
            torch.cuda.synchronize()  # the host copies must land before the storage goes
        freed = 0
        for t, host in self._kept:
            t.untyped_storage().resize_(0)
            freed += host.numel()
        self._dropped = []
        for t in grads:
            n = t.untyped_storage().nbytes()
            t.untyped_storage().resize_(0)
            self._dropped.append((t, n))
            freed += n
        self.offloaded = True
        if not (self.optimizer and self._stateless_params()):
            self._host.trim()  # the prediction is settled: free what no offload took
        return OffloadReport(freed, time.perf_counter() - t0, waited)

    def reload(self) -> OffloadReport:
        """Bring the state back (gradients zeroed); a no-op when nothing is offloaded."""
        if not self.offloaded:
            return OffloadReport(0, 0.0)
        t0 = time.perf_counter()
        total = 0
        for t, host in self._kept:
            t.untyped_storage().resize_(host.numel())
            _storage_bytes(t).copy_(host, non_blocking=host.is_pinned())
            total += host.numel()
        for t, n in self._dropped:
            t.untyped_storage().resize_(n)
            _storage_bytes(t).zero_()
            total += n
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies out of the host buffers are done
        for _, host in self._kept:
            self._host.give(host)
        self._kept, self._dropped, self.offloaded = [], [], False
        return OffloadReport(total, time.perf_counter() - t0)
