"""What one weight sync cost: bytes per link, time per phase, extra memory.

Every path that moves weights into vLLM (the direct bridge, the gather-and-broadcast
baseline, the raw flat-buffer yardstick) reports a ``SyncStats`` per rank; ``SyncReport``
merges the ranks of one sync into the figures the bench prints and the trainer logs.

Phases (seconds, per rank):
- ``pack``: copying source slices into flat send buckets (``narrow`` + ``copy_``);
- ``transfer``: time the rank spent blocked waiting on the network (overlapped network
  time is not counted);
- ``unpack``: copying received buckets (and in-process links) into destination shards;
- ``load``: time inside ``deliver`` (the vLLM receiver's per-tensor load), including any
  post-load processing vLLM ran there;
- ``finish``: the transport's ``finish`` callable (close of vLLM's reload session, cache
  reset);
- ``handshake``: the one-off plan-fingerprint exchange (first sync only).

``breakdown()`` splits a sync's wall time into disjoint phases that sum to it: handshake,
pack, transfer, unpack, ``vllm_load`` (writing the shards, processing excluded),
``vllm_post`` (vLLM's ``process_weights_after_loading``: the CPU GEMM repack, wherever it
ran), ``cache_reset`` (vLLM's prefix-cache reset) and ``other`` (the rest: Python
bookkeeping of transport and session).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


def link_key(src: int, dst: int) -> str:
    """JSON-friendly key of a (src_rank, dst_rank) link."""
    return f"{src}->{dst}"


@dataclass
class SyncStats:
    """One rank's view of one sync."""

    rank: int
    method: str = "direct"
    """``direct``, ``baseline`` or ``raw``."""
    sync_index: int = 0
    bytes_per_link: dict[str, int] = field(default_factory=dict)
    """Bytes this rank SENT (or copied in-process) per link ``"src->dst"``; a link is
    counted by its sender only, so summing over ranks counts every byte once."""
    bytes_sent: int = 0
    """Bytes put on the wire by this rank."""
    bytes_received: int = 0
    bytes_local: int = 0
    """Bytes copied in-process (src_rank == dst_rank, colocated)."""
    minimal_bytes: int = 0
    """The plan's minimal bytes (global, the same on every rank)."""
    buckets_sent: int = 0
    buckets_received: int = 0
    pack_s: float = 0.0
    transfer_s: float = 0.0
    unpack_s: float = 0.0
    load_s: float = 0.0
    finish_s: float = 0.0
    handshake_s: float = 0.0
    post_s: float = 0.0
    """vLLM's post-load processing (part of ``load_s`` and ``finish_s``)."""
    cache_reset_s: float = 0.0
    """vLLM's prefix-cache reset (part of ``finish_s``)."""
    total_s: float = 0.0
    peak_bucket_bytes: int = 0
    """Bytes of flat bucket buffers this rank holds (send + receive), reused across syncs:
    the transport's extra memory beyond the destination shards themselves."""
    dst_bytes: int = 0
    """Bytes of destination shards this rank built."""

    def breakdown(self) -> dict[str, float]:
        """Disjoint phases (seconds) that sum to ``total_s`` (see the module docstring)."""
        parts = {
            "handshake": self.handshake_s,
            "pack": self.pack_s,
            "transfer": self.transfer_s,
            "unpack": self.unpack_s,
            "vllm_load": max(0.0, self.load_s + self.finish_s - self.post_s - self.cache_reset_s),
            "vllm_post": self.post_s,
            "cache_reset": self.cache_reset_s,
        }
        parts["other"] = max(0.0, self.total_s - sum(parts.values()))
        return parts

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SyncReport:
    """All ranks of one sync, merged."""

    method: str
    minimal_bytes: int
    bytes: int
    """Bytes moved (wire + in-process), summed over senders."""
    wire_bytes: int
    local_bytes: int
    bytes_per_link: dict[str, int]
    seconds: float
    """Wall time of the sync: the slowest rank's total."""
    pack_s: float
    transfer_s: float
    unpack_s: float
    load_s: float
    finish_s: float
    handshake_s: float
    peak_bucket_bytes: int
    """The largest per-rank bucket memory."""
    breakdown: dict[str, float] = field(default_factory=dict)
    """The slowest rank's ``SyncStats.breakdown()``: phases summing to ``seconds``."""
    ranks: list[dict] = field(default_factory=list)

    @classmethod
    def merge(cls, stats: list[SyncStats]) -> SyncReport:
        if not stats:
            raise ValueError("SyncReport.merge needs the stats of at least one rank.")
        links: dict[str, int] = {}
        for s in stats:
            for k, v in s.bytes_per_link.items():
                links[k] = links.get(k, 0) + v
        wire = sum(s.bytes_sent for s in stats)
        local = sum(s.bytes_local for s in stats)
        # Phase figures are the slowest rank's: a sync is over when its last rank is.
        return cls(
            method=stats[0].method,
            minimal_bytes=stats[0].minimal_bytes,
            bytes=wire + local,
            wire_bytes=wire,
            local_bytes=local,
            bytes_per_link=dict(sorted(links.items())),
            seconds=max(s.total_s for s in stats),
            pack_s=max(s.pack_s for s in stats),
            transfer_s=max(s.transfer_s for s in stats),
            unpack_s=max(s.unpack_s for s in stats),
            load_s=max(s.load_s for s in stats),
            finish_s=max(s.finish_s for s in stats),
            handshake_s=max(s.handshake_s for s in stats),
            peak_bucket_bytes=max(s.peak_bucket_bytes for s in stats),
            breakdown=max(stats, key=lambda s: s.total_s).breakdown(),
            ranks=[s.to_dict() for s in sorted(stats, key=lambda s: s.rank)],
        )

    def to_dict(self, with_ranks: bool = False) -> dict:
        d = asdict(self)
        if not with_ranks:
            d.pop("ranks")
        return d
