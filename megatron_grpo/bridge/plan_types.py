"""The data model of a weight sync: which slices move from which trainer rank to which
vLLM rank. Computed once per (model, trainer TP/PP[/VPP], rollout TP, rank placement) by
``megatron_grpo.bridge.plan`` from the layouts module; executed by the transport.

Every copy moves a contiguous range along ONE dimension: column-parallel tensors (QKV,
gate/up, vocabulary rows, biases) slice along dim 0, row-parallel ones (o_proj/linear_proj,
down_proj/linear_fc2) along dim 1, replicated ones (norms) copy whole (dim 0, full length).
Destination ranges that no copy covers are vLLM's vocabulary padding and stay zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def row_elems(shape: tuple[int, ...], dim: int) -> int:
    """Elements in one index of ``dim``: the product of every other dimension of ``shape``."""
    n = 1
    for i, s in enumerate(shape):
        if i != dim:
            n *= s
    return n


@dataclass(frozen=True)
class Copy:
    """``dst[dst_name].narrow(dim, dst_start, length) <- src[src_name].narrow(dim, src_start, length)``."""

    src_rank: int
    """Global rank of the trainer process that holds the source shard."""
    src_name: str
    """Key of the source shard in that rank's trainer state (Megatron name, local layer
    index, prefixed by the virtual-pipeline chunk as ``chunk{c}.`` when vpp is used)."""
    dst_rank: int
    """Global rank of the process hosting the destination vLLM TP rank."""
    dst_name: str
    """vLLM parameter name (global layer index), e.g. ``model.layers.3.self_attn.qkv_proj.weight``."""
    dim: int
    src_start: int
    dst_start: int
    length: int


@dataclass(frozen=True)
class DstTensor:
    """One vLLM parameter shard that a sync builds on one destination rank."""

    rank: int
    name: str
    shape: tuple[int, ...]


@dataclass
class SyncPlan:
    copies: list[Copy] = field(default_factory=list)
    dst_tensors: list[DstTensor] = field(default_factory=list)
    element_size: int = 4
    """Bytes per element on the wire (4 for fp32, 2 for bf16)."""

    @property
    def minimal_bytes(self) -> int:
        """Sum of every vLLM shard that must arrive; replicated shards count per receiving rank.

        Zero padding rows are excluded: they are filled on the receiver, never sent.
        """
        return sum(c.length * self._row_elems(c) for c in self.copies) * self.element_size

    def _row_elems(self, c: Copy) -> int:
        return row_elems(self._dst_shapes()[(c.dst_rank, c.dst_name)], c.dim)

    def _dst_shapes(self) -> dict[tuple[int, str], tuple[int, ...]]:
        cache = getattr(self, "_shape_cache", None)
        if cache is None or len(cache) != len(self.dst_tensors):
            cache = {(d.rank, d.name): d.shape for d in self.dst_tensors}
            self._shape_cache = cache
        return cache

    def copy_bytes(self, c: Copy) -> int:
        return c.length * self._row_elems(c) * self.element_size

    def bytes_per_link(self) -> dict[tuple[int, int], int]:
        """(src_rank, dst_rank) -> bytes; a link with src == dst is an in-process copy."""
        out: dict[tuple[int, int], int] = {}
        for c in self.copies:
            key = (c.src_rank, c.dst_rank)
            out[key] = out.get(key, 0) + self.copy_bytes(c)
        return out
