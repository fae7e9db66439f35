"""The vLLM side of the resharding bridge: load already-sharded per-rank tensors, in vLLM's
own layout, into the model held by one vLLM worker.

Why not ``model.load_weights``: vLLM's loaders take *full* HF tensors and narrow them to
this rank (``vllm/model_executor/parameter.py``: ``load_qkv_weight``,
``load_merged_column_weight``, ``load_row_parallel_weight`` narrow by ``self.tp_rank``;
``vllm/model_executor/layers/vocab_parallel_embedding.py: weight_loader`` asserts the full
vocabulary). The bridge sends each rank exactly its shard (DESIGN.md §2), already narrowed,
fused (``qkv_proj`` = this rank's q heads, then k, then v; ``gate_up_proj`` = its gate rows
then its up rows) and vocabulary-padded. So the shard must be copied as is.

Why not write into the parameters: on CPU, vLLM repacks linear weights after loading
(``vllm/model_executor/layers/utils.py: dispatch_cpu_unquantized_gemm`` replaces
``layer.weight`` by an empty ``(0,)`` parameter and keeps a packed oneDNN/sgl handle), and
quantized GPU layers do the same. Weights must re-enter through vLLM's reload path
(``vllm/model_executor/model_loader/reload/layerwise.py``):

1. ``initialize_layerwise_reload(model)`` saves the processed ("kernel") tensors, puts each
   layer back in its loadable form (meta tensors of the logical shapes, recorded at model
   build by ``record_metadata_for_reloading``) and wraps every parameter's
   ``weight_loader`` in ``online_process_loader``, which buffers the loader call and counts
   loaded elements (``CopyCounter``).
2. When a layer has received all its elements, ``_layerwise_process`` materializes it, runs
   the buffered loader calls, runs ``quant_method.process_weights_after_loading`` (the CPU
   repacking) and copies the result into the saved kernel tensors.
3. ``finalize_layerwise_reload`` processes the remaining layers and restores unloaded ones.

For models without quantized layers a session skips that machinery (``_DirectSession``):
shards are written into the live parameters where they keep their logical shape, and a
repacked layer is rebuilt from its shards, processed by vLLM's own
``process_weights_after_loading`` and copied into its kernel tensors -- the same steps
``_layerwise_process`` takes, without moving every module to meta and back, running each
loader twice (``CopyCounter``) or walking every module at finish. The rest of this text is
the layerwise path, kept for quantized layers and HF reloads.

The one change this module makes: inside a bridge session, each parameter's *original*
loader (the one the wrapper calls) is a plain shape-checked copy, installed by re-wrapping
the parameter with vLLM's own ``make_online_process_loader``; the previous loaders are put
back at ``finish``. Everything else (buffering, processing, repacking, kernel-tensor
preservation) is vLLM's.

Read-back: after processing the live parameters may be repacked, so the logical tensors are
captured at the moment vLLM processes each layer (a wrapper around
``quant_method.process_weights_after_loading``): what is captured is exactly the tensor vLLM
repacks. Unprocessed parameters (norms, embeddings, everything on GPU without quantization)
are read live. ``checksums()`` thus proves what each parameter held in vLLM's layout right
before post-load processing; it does not prove that the repacking itself is right -- the
logprob checks in the tests cover that.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_grpo.bridge.checksum import Checksum, checksum

log = logging.getLogger(__name__)

_VOCAB_PARAMS = ("embed_tokens.weight", "lm_head.weight")


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


def _unknown_parameter(name: str, expected: Iterable[str]) -> KeyError:
    return KeyError(
        f"{name!r} is not a parameter of this vLLM model (tied lm_head? HF name?); "
        f"expected vLLM names such as {sorted(expected)[:4]}."
    )


# quant methods whose ``process_weights_after_loading`` only derives kernel state from the
# logical weights (vllm/model_executor/layers/linear.py: UnquantizedLinearMethod,
# vocab_parallel_embedding.py: UnquantizedEmbeddingMethod): on CPU a packed GEMM handle
# (dispatch_cpu_unquantized_gemm), elsewhere nothing or a re-layout of the same values.
# Re-running it on freshly written logical weights is exactly what a reload does.
_DIRECT_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})


@dataclass
class _Module:
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


class ShardReceiver:
    """Loads per-rank vLLM-layout shards into one worker's model; version and checksums.

    Session protocol: ``start()``, any number of ``receive_shard``/``receive_shards`` calls,
    ``finish()``. ``load_hf_checkpoint`` runs a session with vLLM's
    own (narrowing) loaders instead, for read-back of an HF load.
    """

    def __init__(
        self, model: torch.nn.Module, model_config: Any, keep_copies: bool = False
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.keep_copies = keep_copies
        self.version = 0
        self._captured: dict[str, torch.Tensor] = {}
        self._captured_sums: dict[str, Checksum] = {}
        self._session: _Session | None = None
        self._expected: dict[str, tuple[torch.nn.Module, str, tuple[int, ...], torch.dtype]] = {}
        self._tied: list[tuple[str, torch.nn.Module]] = []
        self.record_checksums = True
        """Record the checksum of every repacked parameter as it is processed (what
        ``checksums()`` reads for them). Off, a sync skips that work and ``checksums()``
        omits those parameters until a session records them again (``sync.verify``)."""
        self.timings: dict[str, float] = {}
        """The latest session's vLLM-side seconds: ``post_s`` (post-load processing,
        ``process_weights_after_loading``), the sync breakdown's ``vllm_post`` phase."""
        self._build_index()

    # -- index of the logical (loadable) parameters
    def _build_index(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        modules = dict(self.model.named_modules())
        for name, live in self.model.named_parameters():  # tied duplicates are dropped
            prefix, _, attr = name.rpartition(".")
            module = modules[prefix]
            meta = get_layerwise_info(module).restore_metadata[0].get(attr)
            ref = meta if meta is not None else live  # e.g. `bias` is never moved to meta
            self._expected[name] = (module, attr, tuple(ref.shape), ref.dtype)
        # Modules that share a parameter with another module (tied lm_head): vLLM's reload
        # loads and processes only the owner (reload/__init__.py, "Limitations 2"), but on
        # CPU the tied lm_head keeps its own packed GEMM copy made at start
        # (vocab_parallel_embedding.py: UnquantizedEmbeddingMethod.process_weights_after_
        # loading -> dispatch_cpu_unquantized_gemm(remove_weight=False)), which then goes
        # stale: logits would use the old embedding. ``finish`` re-processes these modules.
        owners = {id(p) for p in self.model.parameters()}
        seen: set[int] = set()
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) in seen and id(p) in owners:
                prefix = name.rpartition(".")[0]
                module = modules[prefix]
                if getattr(module, "quant_method", None) is not None:
                    self._tied.append((prefix, module))
            seen.add(id(p))
        self._by_module: dict[str, _Module] = {}
        self._module_of: dict[str, tuple[_Module, torch.nn.Module, str, bool]] = {}
        self.direct = True
        """Every module can take the direct path (no quantized layers): sessions write into
        the live parameters (``_DirectSession``); otherwise vLLM's layerwise reload runs."""
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        head = getattr(self.model, "lm_head", None)
        for name, (module, attr, shape, _) in self._expected.items():
            prefix = name.rpartition(".")[0]
            qm = getattr(module, "quant_method", None)
            if qm is not None and type(qm).__name__ not in _DIRECT_METHODS:
                self.direct = False
            # An input embedding's post-processing only builds the packed GEMM copy that
            # ``quant_method.apply`` uses, and only the LM head calls ``apply``
            # (logits_processor.py); the embedding itself looks rows up in ``weight``
            # (vocab_parallel_embedding.py: ``quant_method.embedding``). A tied lm_head
            # sharing the weight is re-processed on its own (``self._tied``).
            process = qm is not None and not (
                type(module) is VocabParallelEmbedding and module is not head
            )
            m = self._by_module.get(prefix)
            if m is None:
                m = self._by_module[prefix] = _Module(prefix, module, [], False, process)
            m.names.append(name)
            m.repacked |= tuple(getattr(module, attr).shape) != shape
            self._module_of[name] = (m, module, attr, name.endswith(_VOCAB_PARAMS))

    def expected_shards(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{vLLM name: (this rank's logical shape, dtype)}``: what a sync must deliver.
        Shapes are the loadable (pre-repack) ones, not what ``named_parameters`` shows."""
        return {n: (shape, dtype) for n, (_, _, shape, dtype) in self._expected.items()}

    # -- session
    def start(self, presharded: bool = True) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self._session is not None:
            raise RuntimeError("ShardReceiver.start() called twice; call finish() first.")
        self.timings = {"post_s": 0.0}
        if presharded and self.direct:
            self._session = _DirectSession(self)
        else:
            initialize_layerwise_reload(self.model)
            self._session = _Session(self, presharded)

    def receive_shard(self, name: str, tensor: torch.Tensor) -> None:
        """Load one shard (usable as the transport's ``sink(name, tensor)``)."""
        if self._session is None:
            raise RuntimeError(f"{name}: receive outside a session; call start() first.")
        self._session.load(name, tensor)

    def receive_shards(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named_tensors:
            self.receive_shard(name, tensor)

    def finish(self) -> int:
        """Process and install everything loaded; returns the new version."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self._session is None:
            raise RuntimeError("ShardReceiver.finish() without start().")
        session, self._session = self._session, None
        if isinstance(session, _DirectSession):
            session.finish()
        else:
            try:
                finalize_layerwise_reload(self.model, self.model_config)
            finally:
                session.close()
        for prefix, module in self._tied:
            if prefix not in session.processed:
                self._process(module)
        if session.presharded:
            missing = sorted(set(self._expected) - session.loaded)
            if missing:
                log.warning(
                    "weight update v%d left %d parameters unchanged (kept old values): %s",
                    self.version + 1,
                    len(missing),
                    missing[:8],
                )
        self.version += 1
        return self.version

    def _process(self, module: torch.nn.Module) -> None:
        """vLLM's post-load processing of one module, timed (``timings["post_s"]``)."""
        t0 = time.perf_counter()
        module.quant_method.process_weights_after_loading(module)
        self.timings["post_s"] = self.timings.get("post_s", 0.0) + time.perf_counter() - t0

    def load_hf_checkpoint(self, path: str | Path) -> int:
        """Reload an HF checkpoint through the model's own ``load_weights`` (vLLM's narrowing
        loaders) in a reload session, capturing the per-rank logical weights it produces."""
        from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

        files = sorted(str(p) for p in Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors under {path}.")
        self.start(presharded=False)
        try:
            self.model.load_weights(safetensors_weights_iterator(files, use_tqdm_on_load=False))
        finally:
            version = self.finish()
        return version

    # -- read-back
    def _logical(self, name: str) -> torch.Tensor | None:
        module, attr, shape, _ = self._expected[name]
        live = getattr(module, attr)
        if tuple(live.shape) == shape:
            return live.data
        return self._captured.get(name)

    def checksums(self) -> dict[str, Checksum]:
        """Per parameter: checksum of the logical weight this rank holds (vLLM layout).

        Live tensors where the parameter keeps its logical shape; otherwise the value
        captured when vLLM last processed the layer during a session. A parameter repacked
        at engine start and never reloaded since has no readable value and is omitted (run
        ``load_hf_checkpoint`` once to capture the initial state).
        """
        out: dict[str, Checksum] = {}
        for name, (module, attr, shape, _) in self._expected.items():
            live = getattr(module, attr)
            if tuple(live.shape) == shape:
                out[name] = checksum(live)
            elif name in self._captured_sums:
                out[name] = self._captured_sums[name]
        return out

    def export(self) -> dict[str, torch.Tensor]:
        """The logical per-rank shards (CPU copies) in vLLM layout."""
        out = {}
        for name in self._expected:
            t = self._logical(name)
            if t is None:
                raise RuntimeError(
                    f"{name} is repacked and no logical copy was captured: create the engine "
                    "with keep_weight_copies=True and load weights through a session "
                    "(load_hf_checkpoint or a bridge update) before exporting."
                )
            out[name] = t.detach().to("cpu", copy=True)
        return out

    def _capture(self, prefix: str, layer: torch.nn.Module) -> None:
        for attr, p in layer._parameters.items():
            name = f"{prefix}.{attr}" if prefix else attr
            if p is None or name not in self._expected:
                continue
            if self.record_checksums:
                self._captured_sums[name] = checksum(p)
            else:  # a stale value must not pass for the new one
                self._captured_sums.pop(name, None)
            if self.keep_copies:
                self._captured[name] = p.detach().clone()


class _Session:
    """One update: loader swaps and processing hooks, undone by ``close``."""

    def __init__(self, rx: ShardReceiver, presharded: bool) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import make_online_process_loader

        self.rx = rx
        self.presharded = presharded
        self.loaded: set[str] = set()
        self.processed: set[str] = set()
        self._restore: list[Callable[[], None]] = []
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
                rx._capture(prefix, layer)
                t0 = time.perf_counter()
                try:
                    return _orig(layer)
                finally:
                    rx.timings["post_s"] += time.perf_counter() - t0

            qm.process_weights_after_loading = hook
            self._restore.append(lambda qm=qm: vars(qm).pop("process_weights_after_loading", None))
        if not presharded:
            return
        # Re-wrap every loadable tensor: vLLM's wrapper around a plain copy loader.
        for name, (module, attr, _, _) in rx._expected.items():
            t = getattr(module, attr)
            previous = t.weight_loader
            t.weight_loader = _copy_presharded
            t._mgrpo_name = name
            t._mgrpo_vocab = name.endswith(_VOCAB_PARAMS)
            t.weight_loader = make_online_process_loader(module, attr)
            self._restore.append(lambda t=t, prev=previous: setattr(t, "weight_loader", prev))

    def load(self, name: str, tensor: torch.Tensor) -> None:
        if not self.presharded:
            raise RuntimeError("this session loads HF tensors through model.load_weights.")
        entry = self.rx._expected.get(name)
        if entry is None:
            raise _unknown_parameter(name, self.rx._expected)
        module, attr, _, _ = entry
        param = getattr(module, attr)
        param.weight_loader(param, tensor)
        self.loaded.add(name)

    def close(self) -> None:
        for undo in reversed(self._restore):
            undo()
        self._restore.clear()


class _DirectSession:
    """One update without vLLM's layerwise machinery, for models with no quantized layer.

    vLLM's reload (``_Session``) moves every module to meta tensors at start, runs each
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

    def __init__(self, rx: ShardReceiver) -> None:
        self.rx = rx
        self.presharded = True
        self.loaded: set[str] = set()
        self.processed: set[str] = set()
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    def load(self, name: str, tensor: torch.Tensor) -> None:
        entry = self.rx._module_of.get(name)
        if entry is None:
            raise _unknown_parameter(name, self.rx._expected)
        m, module, attr, vocab = entry
        if name in self.loaded:
            raise RuntimeError(f"{name}: received twice in one weight update.")
        self.loaded.add(name)
        if not m.repacked:
            _copy_shard(getattr(module, attr).data, tensor, name, vocab)
            if m.process and all(n in self.loaded for n in m.names):
                self._processed(m)
            return
        shape, dtype = self.rx._expected[name][2:]
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name}: incoming shard has shape {tuple(tensor.shape)} but this vLLM "
                f"rank's logical parameter is {shape}; the sender must send exactly the "
                "rank's (fused) shard -- check the sync plan against "
                "ShardReceiver.expected_shards()."
            )
        pending = self._pending.setdefault(m.prefix, {})
        pending[attr] = tensor.to(dtype).contiguous()
        if len(pending) == len(m.names):
            self._repack(m, self._pending.pop(m.prefix))

    def _processed(self, m: _Module) -> None:
        self.processed.add(m.prefix)
        self.rx._process(m.module)

    def _repack(self, m: _Module, tensors: dict[str, torch.Tensor]) -> None:
        module = m.module
        kernel = {a: p for a, p in module._parameters.items() if p is not None}
        for attr, t in tensors.items():
            module._parameters[attr] = torch.nn.Parameter(t, requires_grad=False)
        self.rx._capture(m.prefix, module)
        try:
            self._processed(m)
            for attr, p in kernel.items():  # processed values into the kernel storage
                p.data.copy_(module._parameters[attr])
        finally:
            for attr, p in kernel.items():
                module._parameters[attr] = p

    def finish(self) -> None:
        partial = sorted(p for p in self._pending)
        self._pending.clear()
        if partial:
            raise RuntimeError(
                f"weight update left repacked layers {partial[:4]} partly loaded: a repacked "
                "layer's logical weights are gone after vLLM's processing, so an update must "
                "carry all of its parameters (send every shard of the layer)."
            )
        for m in self.rx._by_module.values():  # processing waits on parameters never sent
            if m.process and not m.repacked and m.prefix not in self.processed:
                if any(n in self.loaded for n in m.names):
                    self._processed(m)
