"""One weight update on the vLLM side: the sessions ``ShardReceiver.start`` opens.

- ``LayerwiseSession``: vLLM's layerwise reload (``vllm/model_executor/model_loader/reload/
  layerwise.py``), kept for quantized layers and HF reloads. The one change it makes: each
  parameter's *original* loader (the one vLLM's wrapper calls) is a plain shape-checked copy,
  installed by re-wrapping the parameter with vLLM's own ``make_online_process_loader``; the
  previous loaders are put back at ``close``. Everything else (buffering, processing,
  repacking, kernel-tensor preservation) is vLLM's.
- ``DirectSession``: for models without quantized layers, shards are written into the live
  parameters where they keep their logical shape, and a repacked layer is rebuilt from its
  shards, processed by vLLM's own ``process_weights_after_loading`` and copied into its
  kernel tensors (docs/bridge.md, "vLLM side").

Both see the receiver (``bridge.receiver.ShardReceiver``) through ``Receiver``: its index of
parameters, and the hooks they report back through.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

VOCAB_PARAMS = ("embed_tokens.weight", "lm_head.weight")


def _copy_presharded(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Loader used inside a bridge session: the incoming tensor IS this rank's shard."""
    name = getattr(param, "_mgrpo_name", "?")
    _copy_shard(param.data, loaded_weight, name, getattr(param, "_mgrpo_vocab", False))


def _copy_shard(dst: torch.Tensor, t: torch.Tensor, name: str, vocab: bool) -> None:
    """``t`` (this rank's shard) into the live tensor ``dst``; a vocabulary parameter may
    receive fewer rows than it has (the rows past the real vocabulary are padding)."""
    if tuple(t.shape) != tuple(dst.shape):
        if not (
            vocab and t.dim() == 2 and t.shape[1] == dst.shape[1] and t.shape[0] <= dst.shape[0]
        ):
            raise ValueError(
                f"{name}: incoming shard has shape {tuple(t.shape)} but this vLLM rank's "
                f"parameter is {tuple(dst.shape)}; the sender must send exactly the rank's "
                "(fused, vocabulary-padded) shard -- check the sync plan against "
                "ShardReceiver.expected_shards()."
            )
        dst[t.shape[0] :].zero_()  # vocabulary rows past the real vocabulary: padding
        dst[: t.shape[0]].copy_(t)
        return
    dst.copy_(t)


def post_process(module: torch.nn.Module) -> None:
    """vLLM's post-load processing of one module after its logical weights were rewritten.

    ``quant_method.process_weights_after_loading``, plus, for a fused MoE layer on CPU, the
    experts kernel's own prepack: vLLM runs ``moe_kernel.fused_experts.
    process_weights_after_loading`` only on the first load (unquantized_fused_moe_method.py
    ``_setup_kernel``: "Setup moe kernel only on the first call"), and the CPU experts
    (layers/fused_moe/experts/cpu_moe.py ``CPUUnquantizedExperts``) prepack w13/w2 there, so
    an update would leave unpacked values in the prepacked layout (vLLM's own reload too:
    log-probs off by 5e-2 on tiny-moe). On GPU that hook only sets up the kernel and is
    left to vLLM."""
    quant_method: Any = module.quant_method  # a vLLM layer's (nn.Module types it Tensor | Module)
    kernel_before = getattr(quant_method, "moe_kernel", None)
    quant_method.process_weights_after_loading(module)
    _reprepack_cpu_experts(module, kernel_before)


def _reprepack_cpu_experts(module: torch.nn.Module, kernel_before: Any) -> None:
    """The CPU experts' prepack that vLLM skips when a fused MoE layer already had a kernel
    (``post_process``); nothing for other layers or on GPU."""
    if kernel_before is None:
        return
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        kernel_before.fused_experts.process_weights_after_loading(module)


def _unknown_parameter(name: str, expected: Iterable[str]) -> KeyError:
    return KeyError(
        f"{name!r} is not a parameter of this vLLM model (tied lm_head? HF name?); "
        f"expected vLLM names such as {sorted(expected)[:4]}."
    )


@dataclass
class DirectModule:
    """One vLLM module's parameters, as the direct path sees them."""

    prefix: str
    module: torch.nn.Module
    names: list[str]
    """Expected parameter names (vLLM) of this module."""
    repacked: bool
    """Some parameter no longer has its logical shape (CPU GEMM repack): the module's
    logical tensors are rebuilt from the shards and post-processed, then copied into the
    kernel tensors."""
    process: bool
    """The module has a quant method whose post-processing must re-run after a write."""


class Receiver(Protocol):
    """What a session uses of ``ShardReceiver``."""

    model: torch.nn.Module
    params: dict[str, tuple[torch.nn.Module, str, tuple[int, ...], torch.dtype]]
    """``{vLLM name: (module, attribute, logical shape, dtype)}``."""
    slots: dict[str, int]
    """``{expert slot name: its row of the fused parameter}`` (``layouts.vllm.expert_slot``)."""
    slot_counts: dict[str, int]
    by_prefix: dict[str, DirectModule]
    module_of: dict[str, tuple[DirectModule, torch.nn.Module, str, bool]]
    timings: dict[str, float]

    def capture(self, prefix: str, layer: torch.nn.Module) -> None: ...

    def process(self, module: torch.nn.Module) -> None: ...


class LayerwiseSession:
    """One update: loader swaps and processing hooks, undone by ``close``."""

    def __init__(self, rx: Receiver, presharded: bool) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import make_online_process_loader

        self.rx = rx
        self.presharded = presharded
        self.loaded: set[str] = set()
        self.processed: set[str] = set()
        self._restore: list[Callable[[], object]] = []
        prefixes = {id(m): p for p, m in rx.model.named_modules()}
        # Capture logical tensors right before vLLM's post-load processing (the repack).
        for module in rx.model.modules():
            qm = getattr(module, "quant_method", None)
            if qm is None or "process_weights_after_loading" in vars(qm):
                continue
            original = qm.process_weights_after_loading

            def hook(layer: torch.nn.Module, _orig: Callable = original) -> Any:
                prefix = prefixes.get(id(layer), "")
                self.processed.add(prefix)
                rx.capture(prefix, layer)
                t0 = time.perf_counter()
                kernel_before = getattr(layer.quant_method, "moe_kernel", None)
                try:
                    out = _orig(layer)
                    _reprepack_cpu_experts(layer, kernel_before)
                    return out
                finally:
                    rx.timings["post_s"] += time.perf_counter() - t0

            qm.process_weights_after_loading = hook
            self._restore.append(
                functools.partial(vars(qm).pop, "process_weights_after_loading", None)
            )
        if not presharded:
            return
        # Re-wrap every loadable tensor: vLLM's wrapper around a plain copy loader.
        for name, (module, attr, _, _) in rx.params.items():
            if name in rx.slots:  # refused in ``load``
                continue
            t = getattr(module, attr)
            previous = t.weight_loader
            t.weight_loader = _copy_presharded
            t._mgrpo_name = name
            t._mgrpo_vocab = name.endswith(VOCAB_PARAMS)
            t.weight_loader = make_online_process_loader(module, attr)
            self._restore.append(functools.partial(setattr, t, "weight_loader", previous))

    def load(self, name: str, tensor: torch.Tensor) -> None:
        if not self.presharded:
            raise RuntimeError("this session loads HF tensors through model.load_weights.")
        entry = self.rx.params.get(name)
        if entry is None:
            raise _unknown_parameter(name, self.rx.params)
        if name in self.rx.slots:
            raise ValueError(
                f"{name}: MoE expert slots load through the direct path only, and this model "
                "has quantized layers: sync an unquantized MoE model (docs/moe.md)."
            )
        module, attr, _, _ = entry
        param = getattr(module, attr)
        param.weight_loader(param, tensor)
        self.loaded.add(name)

    def close(self) -> None:
        for undo in reversed(self._restore):
            undo()
        self._restore.clear()


class DirectSession:
    """One update without vLLM's layerwise machinery, for models with no quantized layer.

    vLLM's reload (``LayerwiseSession``) moves every module to meta tensors at start, runs each
    loader twice (once under ``CopyCounter`` to count elements, once for real), and walks
    every module at finish; for an unquantized model all of that reproduces what a plain
    write does. Here:

    - a module whose parameters keep their logical shape (norms, embeddings, every
      unquantized layer on GPU) gets each shard copied into the live parameter storage;
      if it has a quant method (the CPU embedding/lm_head keep a packed GEMM copy), vLLM's
      ``process_weights_after_loading`` re-runs on it once all its parameters arrived;
    - a repacked module (CPU linear layers: ``weight`` is a ``(0,)`` placeholder next to a
      packed handle) gets its logical parameters rebuilt from the shards themselves (no
      copy), ``process_weights_after_loading`` repacks them, and the results are copied
      into the kernel tensors, which go back in place -- the same steps as vLLM's
      ``_layerwise_process`` + ``_copy_and_restore_kernel_tensors``
      (``reload/layerwise.py``), which keep references held elsewhere valid.
    """

    def __init__(self, rx: Receiver) -> None:
        self.rx = rx
        self.presharded = True
        self.loaded: set[str] = set()
        self.processed: set[str] = set()
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._arrived: dict[str, int] = {}
        """Per repacked module: how many of its names arrived this session."""

    def load(self, name: str, tensor: torch.Tensor) -> None:
        entry = self.rx.module_of.get(name)
        if entry is None:
            raise _unknown_parameter(name, self.rx.params)
        m, module, attr, vocab = entry
        if name in self.loaded:
            raise RuntimeError(f"{name}: received twice in one weight update.")
        self.loaded.add(name)
        slot = self.rx.slots.get(name)
        if not m.repacked:
            _copy_shard(getattr(module, attr).data, tensor, name, vocab)
            if m.process and all(n in self.loaded for n in m.names):
                self._processed(m)
            return
        shape, dtype = self.rx.params[name][2:]
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name}: incoming shard has shape {tuple(tensor.shape)} but this vLLM "
                f"rank's logical parameter is {shape}; the sender must send exactly the "
                "rank's (fused) shard -- check the sync plan against "
                "ShardReceiver.expected_shards()."
            )
        pending = self._pending.setdefault(m.prefix, {})
        if slot is None:
            pending[attr] = tensor.to(dtype).contiguous()
        else:  # expert e of a fused MoE parameter: row e of the logical tensor
            fused = pending.get(attr)
            if fused is None:
                count = self.rx.slot_counts[name.rpartition(".")[0]]
                fused = pending[attr] = torch.empty((count, *shape), dtype=dtype)
            fused[slot].copy_(tensor)
        arrived = self._arrived[m.prefix] = self._arrived.get(m.prefix, 0) + 1
        if arrived == len(m.names):
            del self._arrived[m.prefix]
            self._repack(m, self._pending.pop(m.prefix))

    def _processed(self, m: DirectModule) -> None:
        self.processed.add(m.prefix)
        self.rx.process(m.module)

    def _repack(self, m: DirectModule, tensors: dict[str, torch.Tensor]) -> None:
        module = m.module
        kernel = {a: p for a, p in module._parameters.items() if p is not None}
        for attr, t in tensors.items():
            module._parameters[attr] = torch.nn.Parameter(t, requires_grad=False)
        self.rx.capture(m.prefix, module)
        try:
            self._processed(m)
            for attr, p in kernel.items():  # processed values into the kernel storage
                p.data.copy_(getattr(module, attr))
        finally:
            for attr, p in kernel.items():
                module._parameters[attr] = p

    def finish(self) -> None:
        partial = sorted(p for p in self._pending)
        self._pending.clear()
        self._arrived.clear()
        if partial:
            raise RuntimeError(
                f"weight update left repacked layers {partial[:4]} partly loaded: a repacked "
                "layer's logical weights are gone after vLLM's processing, so an update must "
                "carry all of its parameters (send every shard of the layer)."
            )
        for m in self.rx.by_prefix.values():  # processing waits on parameters never sent
            if m.process and not m.repacked and m.prefix not in self.processed:
                if any(n in self.loaded for n in m.names):
                    self._processed(m)
