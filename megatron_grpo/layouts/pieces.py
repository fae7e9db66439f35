"""The slice algebra every layout is written in.

A *shard* (one Megatron TP rank's part of a parameter, one vLLM TP rank's part of a
parameter, or a whole HF tensor) is described as an ordered list of :class:`Piece` s
concatenated along one dimension ``dim``. Each piece names a range ``[start, start+length)``
of one HF tensor along that same dimension (every other dimension is taken whole), or is a
zero fill (vocabulary padding). With the HF tensors as the shared coordinate system:

- HF -> shard: concatenate the HF slices (:func:`assemble`);
- shard -> HF: write every piece back (:func:`scatter`);
- shard -> shard (Megatron -> vLLM): intersect the two piece lists (:func:`intersect`).

Nothing here knows a model family; ``megatron.py``, ``vllm.py`` and ``hf.py`` build the
piece lists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    """``length`` entries along the shard's ``dim``: HF tensor ``src`` from ``start``, or zeros."""

    src: str | None
    """HF tensor name; ``None`` is a zero fill (padding rows that exist in no HF tensor)."""
    start: int
    length: int

    @property
    def is_zero(self) -> bool:
        return self.src is None


@dataclass(frozen=True)
class ShardLayout:
    """One tensor as HF slices: ``shape[dim] == sum(p.length for p in pieces)``."""

    name: str
    """The tensor's name in its own world (Megatron local name, vLLM name or HF name)."""
    shape: tuple[int, ...]
    dim: int
    pieces: tuple[Piece, ...]

    def __post_init__(self) -> None:
        total = sum(p.length for p in self.pieces)
        if total != self.shape[self.dim]:
            raise AssertionError(
                f"layout of {self.name}: pieces cover {total} entries along dim {self.dim} "
                f"but the shape is {self.shape}"
            )

    @property
    def hf_names(self) -> tuple[str, ...]:
        """HF tensors this shard reads, in first-use order, without repeats."""
        seen: dict[str, None] = {}
        for p in self.pieces:
            if p.src is not None:
                seen.setdefault(p.src)
        return tuple(seen)

    def offsets(self) -> Iterator[tuple[int, Piece]]:
        """(offset of the piece inside this shard along ``dim``, piece)."""
        off = 0
        for p in self.pieces:
            yield off, p
            off += p.length

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def zero_length(self) -> int:
        """Entries along ``dim`` that are zero fill."""
        return sum(p.length for p in self.pieces if p.src is None)


def merge(pieces: Iterable[Piece]) -> tuple[Piece, ...]:
    """Join consecutive pieces that continue each other (same source, adjacent ranges)."""
    out: list[Piece] = []
    for p in pieces:
        if p.length == 0:
            continue
        if out:
            q = out[-1]
            if q.src == p.src and (q.src is None or q.start + q.length == p.start):
                out[-1] = Piece(q.src, q.start, q.length + p.length)
                continue
        out.append(p)
    return tuple(out)


def cut(pieces: Iterable[Piece], start: int, length: int) -> tuple[Piece, ...]:
    """The sub-list covering ``[start, start+length)`` of the concatenation of ``pieces``.

    Used for Megatron's column split of the fused QKV, which can fall inside a query group
    (megatron/core/transformer/attention.py get_query_key_value_tensors, ng < tp).
    """
    out: list[Piece] = []
    end = start + length
    off = 0
    for p in pieces:
        a, b = max(start, off), min(end, off + p.length)
        if a < b:
            src_start = p.start + (a - off) if p.src is not None else 0
            out.append(Piece(p.src, src_start, b - a))
        off += p.length
    if sum(p.length for p in out) != length:
        raise ValueError(f"cut [{start}, {end}) runs past the end of pieces of length {off}")
    return merge(out)


def vocab_rows(src: str, vocab: int, padded: int, tp: int, rank: int) -> tuple[Piece, ...]:
    """Rows of a vocabulary-parallel shard: ``[rank*padded/tp, ...)`` clipped to ``vocab``,
    followed by zero rows. Shape ``(padded/tp, h)``."""
    per = padded // tp
    lo = rank * per
    real = max(0, min(vocab, lo + per) - lo)
    return merge([Piece(src, lo, real), Piece(None, 0, per - real)])


# ---------------------------------------------------------------------------------------
# Tensor operations on layouts.
# ---------------------------------------------------------------------------------------

TensorSource = Callable[[str, int, int, int], torch.Tensor]
"""``(hf_name, dim, start, length) -> tensor``: the HF slice, every other dim whole."""


def assemble(
    layout: ShardLayout,
    read: TensorSource,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Build the shard ``layout`` (shape ``layout.shape``) from HF slices.

    ``read(name, dim, start, length)`` returns one HF slice; ``out`` (if given) is filled
    in place, which lets a caller write straight into a parameter.
    """
    if out is None:
        first = next(((p.src, p.start) for p in layout.pieces if p.src is not None), None)
        if dtype is None:
            if first is None:
                raise ValueError(f"{layout.name} is all padding: pass dtype")
            dtype = read(first[0], layout.dim, first[1], 1).dtype
        out = torch.empty(layout.shape, dtype=dtype)
    elif tuple(out.shape) != layout.shape:
        raise ValueError(
            f"{layout.name}: target has shape {tuple(out.shape)}, layout {layout.shape}"
        )
    for off, p in layout.offsets():
        dst = out.narrow(layout.dim, off, p.length)
        if p.src is None:
            dst.zero_()
        else:
            piece = read(p.src, layout.dim, p.start, p.length)
            if piece.shape != dst.shape:
                raise ValueError(
                    f"{layout.name}: HF tensor {p.src} slice [{p.start}, {p.start + p.length}) "
                    f"along dim {layout.dim} has shape {tuple(piece.shape)}, expected "
                    f"{tuple(dst.shape)}: the checkpoint does not match its config.json"
                )
            dst.copy_(piece)
    return out


def reader_from_dict(tensors: Mapping[str, torch.Tensor]) -> TensorSource:
    """A :data:`TensorSource` over in-memory full HF tensors."""

    def read(name: str, dim: int, start: int, length: int) -> torch.Tensor:
        try:
            t = tensors[name]
        except KeyError:
            raise KeyError(f"HF tensor {name!r} is missing") from None
        return t.narrow(dim, start, length)

    return read


def scatter(layout: ShardLayout, shard: torch.Tensor, full: Mapping[str, torch.Tensor]) -> None:
    """Write the shard's pieces back into the full HF tensors ``full[name]`` (in place).

    Zero-fill pieces are dropped (they are padding and have no HF home).
    """
    if tuple(shard.shape) != layout.shape:
        raise ValueError(
            f"{layout.name}: shard has shape {tuple(shard.shape)}, layout {layout.shape}"
        )
    for off, p in layout.offsets():
        if p.src is not None:
            full[p.src].narrow(layout.dim, p.start, p.length).copy_(
                shard.narrow(layout.dim, off, p.length)
            )


@dataclass(frozen=True)
class Overlap:
    """``dst.narrow(dim, dst_start, length) == src.narrow(dim, src_start, length)``."""

    hf_name: str
    hf_start: int
    dst_start: int
    src_start: int
    length: int


def intersect(dst: ShardLayout, src: ShardLayout) -> list[Overlap]:
    """Where ``src`` holds entries that ``dst`` needs, in both shards' own offsets.

    Both layouts must slice along the same dim (true for every Megatron/vLLM pair: both
    split the same HF tensors the same way round).
    """
    if dst.dim != src.dim:
        raise ValueError(f"{dst.name} slices dim {dst.dim}, {src.name} dim {src.dim}")
    by_name: dict[str, list[tuple[int, Piece]]] = {}
    for off, p in src.offsets():
        if p.src is not None:
            by_name.setdefault(p.src, []).append((off, p))
    out: list[Overlap] = []
    for doff, d in dst.offsets():
        if d.src is None:
            continue
        for soff, s in by_name.get(d.src, ()):
            a = max(d.start, s.start)
            b = min(d.start + d.length, s.start + s.length)
            if a < b:
                out.append(Overlap(d.src, a, doff + a - d.start, soff + a - s.start, b - a))
    return out
