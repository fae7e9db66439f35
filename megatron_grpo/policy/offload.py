"""Move a trainer's optimizer state, gradients and (optionally) weights off its device.

Colocated on one GPU with vLLM (trainer/memory.py), the trainer holds its state only while
it trains: between the train phase and the next one the GPU belongs to vLLM's weights and
KV cache. What moves, per storage (deduplicated, so views are never copied twice):

- optimizer state (Adam's exp_avg / exp_avg_sq) and the fp32 master weights of 16-bit
  parameters: copied to host memory (pinned when CUDA is present, so the copies run at PCIe
  speed), then the device storage is resized to 0 bytes; ``reload`` re-grows it and copies
  back. Every tensor, view and optimizer reference keeps its identity, so the optimizer
  resumes bit for bit (tests/test_offload.py compares optimizer steps with and without).
- gradients (megatron DDP's ``grad_data`` buffers): freed without a copy, re-grown zeroed.
  They are dead between steps: ``Policy.train_step`` zeroes them before every backward.
- the model weights (``params=True``): copied like the optimizer state. Off by default:
  the weight sync reads them, and pi_k's log-probs need them right after the rollout.

The same storage-resize mechanism megatron uses for its own buffers
(megatron/core/distributed/param_and_grad_buffer.py ``offload_to_cpu``); megatron's
``MegatronOptimizer.offload_to_cpu`` is not used because it rebinds ``p.data`` of the
optimizer's params, which for fp32 models are the model's own weights (views into DDP's
buffers), and does not pin.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OffloadReport:
    bytes: int
    """Device bytes freed (offload) or re-allocated (reload)."""
    seconds: float


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over ``t``'s whole storage."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),))


class TrainerOffload:
    """``offload()`` / ``reload()`` of a trainable ``policy.Policy``'s state (see module doc).

    ``optimizer``: the optimizer state, fp32 masters and gradient buffers; ``params``: the
    model weights. The colocated loop holds one of each so that the weights can stay for
    the weight sync after the optimizer state has left (trainer/memory.py)."""

    def __init__(self, policy, optimizer: bool = True, params: bool = False) -> None:
        if not policy.trainable:
            raise ValueError("TrainerOffload needs a trainable Policy (built with optim_cfg).")
        self.policy = policy
        self.optimizer = optimizer
        self.params = params
        self.offloaded = False
        self._kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device tensor, host copy)
        self._dropped: list[tuple[torch.Tensor, int]] = []  # (device tensor, bytes)
        self._host: list[torch.Tensor] = []  # host buffers, reused while sizes match

    # --------------------------------------------------------------------- collection
    def _model_tensors(self) -> list[torch.Tensor]:
        out = [p for m in self.policy.chunks for p in m.parameters()]
        for buf in self._ddp_buffers():
            if buf.param_data is not None:
                out.append(buf.param_data)
        return out

    def _ddp_buffers(self) -> list:
        return [
            b
            for m in self.policy.chunks
            for b in getattr(m, "buffers", []) + getattr(m, "expert_parallel_buffers", [])
        ]

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        opt = self.policy.optimizer
        out = []
        for sub in getattr(opt, "chained_optimizers", [opt]):
            inner = getattr(sub, "optimizer", None)
            if inner is None or getattr(sub, "is_stub_optimizer", False):
                continue
            for state in inner.state.values():
                out += [v for v in state.values() if isinstance(v, torch.Tensor) and v.numel()]
            for group in inner.param_groups:
                out += list(group["params"])  # fp32 masters; model weights filtered out below
        return out

    @staticmethod
    def _unique(tensors, exclude: set[int]) -> list[torch.Tensor]:
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
        model = self._unique(self._model_tensors(), set())
        model_ptrs = {t.untyped_storage().data_ptr() for t in model}
        grads, keep = [], []
        if self.optimizer:
            grads = self._unique([b.grad_data for b in self._ddp_buffers()], set())
            grad_ptrs = {t.untyped_storage().data_ptr() for t in grads}
            keep = self._unique(self._optimizer_tensors(), model_ptrs | grad_ptrs)
        if self.params:
            keep += model
        pin = torch.cuda.is_available()
        if [h.numel() for h in self._host] != [t.untyped_storage().nbytes() for t in keep]:
            self._host = [
                torch.empty(t.untyped_storage().nbytes(), dtype=torch.uint8, pin_memory=pin)
                for t in keep
            ]
        self._kept = list(zip(keep, self._host))
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
        return OffloadReport(freed, time.perf_counter() - t0)

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
            torch.cuda.synchronize()
        self._kept, self._dropped, self.offloaded = [], [], False
        return OffloadReport(total, time.perf_counter() - t0)
