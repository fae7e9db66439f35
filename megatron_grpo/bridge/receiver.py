"""The vLLM side of the resharding bridge: load already-sharded per-rank tensors, in vLLM's
own layout, into the model held by one vLLM worker.

Not ``model.load_weights``: vLLM's loaders take full HF tensors and narrow them to the rank,
and the bridge sends each rank exactly its shard, already narrowed, fused and padded. Not a
plain write into the parameters either: vLLM repacks layers after loading (CPU GEMMs,
quantized layers). A session takes the direct path (unquantized layers:
``sessions.DirectSession``) or vLLM's own layerwise reload with a shape-checked copy as each
loader (``sessions.LayerwiseSession``); ``checksums()`` reads back what each parameter held
right before post-load processing. Design: docs/rollout.md, "Weight receiver", and
docs/bridge.md, "vLLM side".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from megatron_grpo.bridge.checksum import Checksum, checksum
from megatron_grpo.bridge.sessions import (
    VOCAB_PARAMS,
    DirectModule,
    DirectSession,
    LayerwiseSession,
    post_process,
)
from megatron_grpo.layouts import vllm as vl

log = logging.getLogger(__name__)

# quant methods whose ``process_weights_after_loading`` only derives kernel state from the
# logical weights (vllm/model_executor/layers/linear.py: UnquantizedLinearMethod,
# vocab_parallel_embedding.py: UnquantizedEmbeddingMethod): on CPU a packed GEMM handle
# (dispatch_cpu_unquantized_gemm), elsewhere nothing or a re-layout of the same values.
# Re-running it on freshly written logical weights is exactly what a reload does.
# vLLM's unquantized fused MoE (layers/fused_moe/unquantized_fused_moe_method.py) re-derives
# its kernel layout from w13/w2 the same way (``sessions.post_process`` adds the CPU prepack
# that vLLM skips on updates).
_DIRECT_METHODS = frozenset(
    {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod"}
)


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
        self._session: LayerwiseSession | DirectSession | None = None
        self.params: dict[str, tuple[torch.nn.Module, str, tuple[int, ...], torch.dtype]] = {}
        """``{vLLM name: (module, attribute, logical shape, dtype)}`` of every loadable
        tensor (what the sessions load into): a fused MoE expert parameter appears as its
        expert slots ``<name>.<e>`` (``layouts.vllm.expert_slot``) of shape ``shape[1:]``."""
        self.slots: dict[str, int] = {}
        """``{expert slot name: expert index}``: the slot is row e of its fused parameter."""
        self.slot_counts: dict[str, int] = {}
        """``{fused expert parameter: number of slots}``."""
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
        # remove_duplicate=False: vLLM's FusedMoE also registers the MoE block's router
        # (``mlp.gate``) as ``mlp.experts.gate`` (models/qwen3_moe.py ``FusedMoEFactory(
        # gate=self.gate)``), and ``named_parameters`` may report it under that name.
        modules = dict(self.model.named_modules(remove_duplicate=False))
        self._index_params(modules)
        self._find_tied(modules)
        self._index_direct_modules()

    def _index_params(self, modules: dict[str, torch.nn.Module]) -> None:
        """``params``, ``slots`` and ``slot_counts``: each parameter's logical (loadable)
        shape, from the metadata vLLM recorded at build, a fused expert split in slots."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        for name, live in self.model.named_parameters():  # tied duplicates are dropped
            prefix, _, attr = name.rpartition(".")
            module = modules[prefix]
            meta = get_layerwise_info(module).restore_metadata[0].get(attr)
            ref = meta if meta is not None else live  # e.g. `bias` is never moved to meta
            if vl.expert_slot(f"{name}.0") is not None:
                self.slot_counts[name] = ref.shape[0]
                for e in range(ref.shape[0]):
                    self.params[f"{name}.{e}"] = (module, attr, tuple(ref.shape[1:]), ref.dtype)
                    self.slots[f"{name}.{e}"] = e
                continue
            self.params[name] = (module, attr, tuple(ref.shape), ref.dtype)

    def _find_tied(self, modules: dict[str, torch.nn.Module]) -> None:
        """``_tied``: the processed modules that share a parameter with another module."""
        # A tied lm_head: vLLM's reload
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

    def _index_direct_modules(self) -> None:
        """``by_prefix``, ``module_of`` and ``direct``: the direct path's view of the model,
        which modules are re-processed after a load, which parameters are repacked."""
        self.by_prefix: dict[str, DirectModule] = {}
        """The direct path's view of each module, by its prefix."""
        self.module_of: dict[str, tuple[DirectModule, torch.nn.Module, str, bool]] = {}
        """Per parameter name: (its ``DirectModule``, module, attribute, whether a vocabulary
        parameter)."""
        self.direct = True
        """Every module can take the direct path (no quantized layers): sessions write into
        the live parameters (``DirectSession``); otherwise vLLM's layerwise reload runs."""
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        head = getattr(self.model, "lm_head", None)
        for name, (module, attr, shape, _) in self.params.items():
            fused = name.rpartition(".")[0] if name in self.slots else name
            prefix = fused.rpartition(".")[0]
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
            m = self.by_prefix.get(prefix)
            if m is None:
                m = self.by_prefix[prefix] = DirectModule(prefix, module, [], False, process)
            m.names.append(name)
            # Expert slots: vLLM's CPU MoE prepacks w13/w2 in place of the same shape
            # (layers/fused_moe/experts/cpu_moe.py ``cpu_prepack_moe_weight``), so the live
            # values are never the logical ones: rebuild and re-process them, as a repack.
            m.repacked |= tuple(getattr(module, attr).shape) != shape or name in self.slots
            self.module_of[name] = (m, module, attr, name.endswith(VOCAB_PARAMS))

    def expected_shards(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{vLLM name: (this rank's logical shape, dtype)}``: what a sync must deliver.
        Shapes are the loadable (pre-repack) ones, not what ``named_parameters`` shows."""
        return {n: (shape, dtype) for n, (_, _, shape, dtype) in self.params.items()}

    # -- session
    def start(self, presharded: bool = True) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self._session is not None:
            raise RuntimeError("ShardReceiver.start() called twice; call finish() first.")
        self.timings = {"post_s": 0.0}
        if presharded and self.direct:
            self._session = DirectSession(self)
        else:
            initialize_layerwise_reload(self.model)
            self._session = LayerwiseSession(self, presharded)

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
        if isinstance(session, DirectSession):
            session.finish()
        else:
            try:
                finalize_layerwise_reload(self.model, self.model_config)
            finally:
                session.close()
        for prefix, module in self._tied:
            if prefix not in session.processed:
                self.process(module)
        if session.presharded:
            missing = sorted(set(self.params) - session.loaded)
            if missing:
                log.warning(
                    "weight update v%d left %d parameters unchanged (kept old values): %s",
                    self.version + 1,
                    len(missing),
                    missing[:8],
                )
        self.version += 1
        return self.version

    def process(self, module: torch.nn.Module) -> None:
        """vLLM's post-load processing of one module, timed (``timings["post_s"]``)."""
        t0 = time.perf_counter()
        post_process(module)
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
            model: Any = self.model  # vLLM's model: load_weights is its own method
            model.load_weights(safetensors_weights_iterator(files, use_tqdm_on_load=False))
        finally:
            version = self.finish()
        return version

    # -- read-back
    def _logical(self, name: str) -> torch.Tensor | None:
        module, attr, shape, _ = self.params[name]
        live = getattr(module, attr)
        if tuple(live.shape) == shape and name not in self.slots:
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
        for name, (module, attr, shape, _) in self.params.items():
            live = getattr(module, attr)
            if tuple(live.shape) == shape and name not in self.slots:
                out[name] = checksum(live)
            elif name in self._captured_sums:
                out[name] = self._captured_sums[name]
        return out

    def export(self) -> dict[str, torch.Tensor]:
        """The logical per-rank shards (CPU copies) in vLLM layout."""
        out = {}
        for name in self.params:
            t = self._logical(name)
            if t is None:
                raise RuntimeError(
                    f"{name} is repacked and no logical copy was captured: create the engine "
                    "with keep_weight_copies=True and load weights through a session "
                    "(load_hf_checkpoint or a bridge update) before exporting."
                )
            out[name] = t.detach().to("cpu", copy=True)
        return out

    def capture(self, prefix: str, layer: torch.nn.Module) -> None:
        """Record ``layer``'s logical tensors right before vLLM processes it (checksums, and
        copies when ``keep_copies``): what ``checksums()`` and ``export()`` read back."""
        for attr, p in layer._parameters.items():
            name = f"{prefix}.{attr}" if prefix else attr
            if p is None:
                continue
            count = self.slot_counts.get(name)
            tensors = [(f"{name}.{e}", p[e]) for e in range(count)] if count else [(name, p)]
            for key, t in tensors:
                if key not in self.params:
                    continue
                if self.record_checksums:
                    self._captured_sums[key] = checksum(t)
                else:  # a stale value must not pass for the new one
                    self._captured_sums.pop(key, None)
                if self.keep_copies:
                    self._captured[key] = t.detach().clone()
