"""The anchors' weight sync, measured with the same accounting as the bridge.

What verl, NeMo-RL, slime and Megatron-Bridge do (docs/bridge.md, "Why a bridge"): gather
the TP shards and PP stages into full HF tensors on one rank, send the full tensors to every
vLLM rank (per-tensor broadcast, with a metadata message each sync), and let vLLM's own
``load_weights`` narrow each full tensor to its rank. Here:

1. **gather**: ``layouts.io.iter_hf_tensors`` to ``root`` (point to point, one HF group at
   a time, every shard once);
2. **broadcast**: the list of names and shapes (``broadcast_object_list``), then each full
   tensor with ``dist.broadcast`` from ``root`` to every rank hosting a vLLM rank;
3. **load**: vLLM's ``model.load_weights`` over the stream of full tensors inside the
   receiver's reload session (``ShardReceiver.start(presharded=False)``), then ``finish``
   (post-load processing), exactly what ``RolloutEngine.reload_from_hf`` runs from disk.

Bytes: gather = every gathered shard (wire when its owner is not ``root``, in-process
otherwise); broadcast = every full tensor once per receiving rank (wire) plus ``root``'s
own vLLM rank (in-process).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
import torch.distributed as dist

from megatron_grpo.bridge.accounting import SyncStats, link_key
from megatron_grpo.bridge.plan import rank_lookup


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class BaselineSync:
    """Gather-to-one-rank-then-broadcast sync of a colocated job (every rank hosts one vLLM
    rank). ``engine``: this rank's colocated ``RolloutEngine``, or None to measure the
    transfer alone (``load`` then hands the full tensors to ``deliver`` or drops them). The
    sender numbers the syncs (``SyncStats.sync_index``)."""

    def __init__(
        self,
        models: list,
        spec,
        ctx,
        engine=None,
        *,
        root: int = 0,
        padded_vocab: int | None = None,
        deliver: Callable[[str, torch.Tensor], None] | None = None,
    ) -> None:
        from megatron_grpo.layouts.io import gather_schedule, megatron_layout_of

        self.models, self.spec, self.ctx, self.engine = models, spec, ctx, engine
        self.root = root
        self.deliver = deliver
        ml = megatron_layout_of(models, spec, ctx)
        ml = replace(ml, padded_vocab=padded_vocab or ml.padded_vocab)
        es = next(p for m in models for p in m.parameters()).element_size()
        self.element_size = es
        rank_of = rank_lookup(ml)
        # The gather's traffic, from the same schedule iter_hf_tensors follows.
        self.gather_links: dict[tuple[int, int], int] = {}
        for src in gather_schedule(spec, ml):
            # an expert comes from its EP rank: DP rank ep_rank (DP rank d is EP rank d % ep)
            owner = rank_of(src.ep_rank, src.pp_rank, src.tp_rank)
            key = (owner, root)
            self.gather_links[key] = self.gather_links.get(key, 0) + _numel(src.layout.shape) * es

    def gather_and_broadcast(self) -> SyncStats:
        """One baseline sync: gather the full tensors on ``root``, broadcast them, load them;
        collective over the whole job. Returns this rank's stats."""
        from megatron_grpo.layouts.io import iter_hf_tensors

        ctx, root = self.ctx, self.root
        me = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        st = SyncStats(rank=me, method="baseline")
        t_start = time.perf_counter()

        # 1. gather full HF tensors on root (the funnel).
        t0 = time.perf_counter()
        full = dict(iter_hf_tensors(self.models, self.spec, ctx, dst_rank=root))
        st.pack_s = time.perf_counter() - t0  # "pack" = the gather here
        if me == root:
            self._count_gather(st)

        # 2. metadata, then per-tensor broadcast, consumed lazily by vLLM's load_weights.
        meta = [[(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in full.items()]]
        if world > 1:
            dist.broadcast_object_list(meta, src=root)
        bcast_s = [0.0]
        t0 = time.perf_counter()
        tensors = self._broadcast(full, meta[0], st, bcast_s, me, world)
        if self.engine is not None:
            self._load_into_vllm(tensors)
        else:
            for name, t in tensors:
                if self.deliver is not None:
                    self.deliver(name, t)
        st.transfer_s = bcast_s[0]
        st.load_s = time.perf_counter() - t0 - bcast_s[0]
        if self.engine is not None:
            t0 = time.perf_counter()
            self._finish()
            st.finish_s = time.perf_counter() - t0
        st.total_s = time.perf_counter() - t_start
        st.dst_bytes = sum(_numel(s) for _, s, _ in meta[0]) * self.element_size
        return st

    def _count_gather(self, st: SyncStats) -> None:
        """Root: the gather's bytes per link (counted once, on root: the senders are many)."""
        for (s, d), n in self.gather_links.items():
            st.bytes_per_link[link_key(s, d)] = n
            if s == d:
                st.bytes_local += n
            else:
                st.bytes_sent += n

    def _broadcast(self, full: dict[str, torch.Tensor], meta: list, st: SyncStats,
                   bcast_s: list[float], me: int, world: int,
                   ) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
        """Root's tensors, one broadcast each, in ``meta``'s order, as they arrive (seconds in
        the broadcasts added to ``bcast_s[0]``, bytes counted into ``st``)."""
        root = self.root
        for name, shape, dtype in meta:
            t = full.get(name)
            if t is None:
                t = torch.empty(shape, dtype=getattr(torch, dtype))
            tb = time.perf_counter()
            if world > 1:
                dist.broadcast(t, src=root)
            bcast_s[0] += time.perf_counter() - tb
            nbytes = t.numel() * t.element_size()
            if me == root:
                st.bytes_local += nbytes
                st.bytes_sent += nbytes * (world - 1)
                for r in range(world):
                    k = link_key(root, r)
                    st.bytes_per_link[k] = st.bytes_per_link.get(k, 0) + nbytes
            else:
                st.bytes_received += nbytes
            yield name, t

    # vLLM side: the engine runs vLLM's own narrowing loaders on full HF tensors
    # (``RolloutEngine.begin_hf_update``), fed from memory instead of safetensors.
    def _load_into_vllm(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.engine.begin_hf_update(tensors)

    def _finish(self) -> None:
        self.engine.finish_hf_update()
