"""The yardstick: the same bytes per link as the bridge, each link as ONE flat buffer, over
the same process group. What the transport would take with zero packing, bucketing and
bookkeeping; ``direct.seconds / raw.seconds`` is the bridge's overhead factor."""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_grpo.bridge.accounting import SyncStats, link_key


class RawTransfer:
    """Buffers allocated once; ``run()`` moves them once. In-process links (src == dst)
    are a memcpy of the same size, as the bridge's colocated copies are."""

    def __init__(
        self,
        link_bytes: Mapping[tuple[int, int], int],
        rank: int,
        *,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        timeout_s: float = 600.0,
    ) -> None:
        self.timeout = timedelta(seconds=timeout_s)
        es = torch.empty((), dtype=dtype).element_size()
        self.rank, self.group, self.es = rank, group, es
        self.send = {
            k: torch.ones(n // es, dtype=dtype, device=device)
            for k, n in link_bytes.items()
            if k[0] == rank and k[1] != rank
        }
        self.recv = {
            k: torch.empty(n // es, dtype=dtype, device=device)
            for k, n in link_bytes.items()
            if k[1] == rank and k[0] != rank
        }
        n_local = link_bytes.get((rank, rank), 0) // es
        self.local = (
            (
                torch.ones(n_local, dtype=dtype, device=device),
                torch.empty(n_local, dtype=dtype, device=device),
            )
            if n_local
            else None
        )

    def run(self) -> SyncStats:
        st = SyncStats(rank=self.rank, method="raw")
        t0 = time.perf_counter()
        # NCCL runs a pair's operations on one stream in issue order: both ranks of a pair
        # issue "lower rank's send, then higher rank's send" (bridge.schedule.pair_order).
        works = []
        for peer in sorted({k[1] for k in self.send} | {k[0] for k in self.recv}):
            out, inc = self.send.get((self.rank, peer)), self.recv.get((peer, self.rank))
            for kind in ("send", "recv") if self.rank < peer else ("recv", "send"):
                if kind == "send" and out is not None:
                    works.append(dist.isend(out, dst=peer, group=self.group))
                elif kind == "recv" and inc is not None:
                    works.append(dist.irecv(inc, src=peer, group=self.group))
        if self.local is not None:
            self.local[1].copy_(self.local[0])
            st.bytes_local = self.local[0].numel() * self.es
            st.bytes_per_link[link_key(self.rank, self.rank)] = st.bytes_local
        for w in works:
            # A real bound under NCCL too: wait(timeout) blocks until done (wait() only
            # enqueues); gloo raises naming the op on timeout. (None: a rank outside the group.)
            if w is not None:
                w.wait(timeout=self.timeout)
        st.total_s = st.transfer_s = time.perf_counter() - t0
        for k, b in self.send.items():
            st.bytes_sent += b.numel() * self.es
            st.bytes_per_link[link_key(*k)] = b.numel() * self.es
        st.bytes_received = sum(b.numel() for b in self.recv.values()) * self.es
        return st
