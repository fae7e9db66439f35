"""The copies in and out of a transport's flat buckets, batched.

One ``copy_`` per slice costs a Python call and a kernel launch each: on an H100 that held the
pack at 78 GB/s against 1,359 GB/s for a device copy of the same bytes (tests/gpu/test_gpu.py
``test_bridge_pack_unpack_bandwidth``). So the schedule merges each bucket's entries into runs
(``schedule.Run``), the buffer's views of every run are made once and cached, and a bucket
moves in one ``torch._foreach_copy_`` per source dtype (``copy_batched``): CUDA's multi-tensor
kernel for the contiguous runs, torch's own C++ loop for the strided ones (the dim-1 slices of
row-parallel weights). On CPU that loop is the same ``copy_`` per run, without the Python
around each.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from megatron_grpo.bridge.schedule import Bucket, Run, SyncError


def copy_batched(outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor]) -> None:
    """``outs[i].copy_(ins[i])`` for every i, in one ``torch._foreach_copy_`` per group of
    pairs with the same dtypes.

    On CUDA, a call whose pairs are all dense with equal strides runs as multi-tensor
    kernels (aten/src/ATen/native/cuda/ForeachBinaryOpList.cu
    ``foreach_tensor_copy_list_kernel_cuda_``: many tensors per launch); any other call
    (strided slices, CPU) runs torch's C++ loop of ``copy_`` (``..._kernel_slow_``), which
    spares the Python around each copy. So the dense pairs and the strided ones go in
    separate calls. A cast to the wire dtype (an fp32 model sent in bf16) gives ``copy_``'s
    bits (tests/bridge/test_transport.py on CPU, tests/gpu/test_gpu.py on CUDA)."""
    groups: dict[tuple[torch.dtype, torch.dtype, bool], tuple[list, list]] = {}
    for o, i in zip(outs, ins, strict=True):
        key = (o.dtype, i.dtype, o.is_contiguous() and i.is_contiguous())
        g = groups.get(key)
        if g is None:
            g = groups[key] = ([], [])
        g[0].append(o)
        g[1].append(i)
    with torch.no_grad():  # the sources may be parameters; the copies are not trained
        for group_outs, group_ins in groups.values():
            torch._foreach_copy_(group_outs, group_ins)


class Packer:
    """One rank's pack (sources -> bucket buffer) and unpack (buffer -> destination shards),
    with the buffer views of every (bucket, buffer) pair cached across syncs."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._views: dict[tuple[int, int], tuple] = {}  # _buffer_views' cache

    def source(
        self,
        sources: Mapping[str, torch.Tensor],
        name: str,
        dim: int,
        start: int,
        shape: tuple[int, ...],
        feeds: str,
    ) -> torch.Tensor:
        """Rows ``[start, start + shape[dim])`` of source ``name`` along ``dim``, checked."""
        t = sources.get(name)
        if t is None:
            names = sorted(sources)
            raise SyncError(
                f"rank {self.rank} has no source shard {name!r}, which the plan copies "
                f"to {feeds}; this rank's shards are "
                f"{names[:6]}{' ...' if len(names) > 6 else ''} ({len(names)}). Build the "
                "plan from the same model and parallel layout as the trainer's Policy."
            )
        if start == 0 and t.shape == shape:
            return t  # the whole shard: no view to make
        length = shape[dim]
        if dim >= t.dim() or start + length > t.shape[dim]:
            raise SyncError(
                f"rank {self.rank}: source shard {name!r} has shape {tuple(t.shape)}, "
                f"the plan reads rows [{start}, {start + length}) of dim {dim} "
                f"for {feeds}: the plan and the trainer disagree on this tensor's layout."
            )
        s = t.narrow(dim, start, length)
        if s.shape != shape:
            raise SyncError(
                f"rank {self.rank}: slice of {name!r} has shape {tuple(s.shape)} but "
                f"{feeds} expects {shape}: the plan and the "
                "trainer disagree on this tensor's shape."
            )
        return s

    def _buffer_views(self, bucket: Bucket, buf: torch.Tensor) -> tuple[list, list]:
        """``buf``'s views of ``bucket``'s pack runs and unpack runs, shaped like the slices;
        made once per (bucket, buffer) and reused by every sync (a link's bucket always
        lands in the same slot buffer)."""
        key = (id(bucket), id(buf))
        hit = self._views.get(key)
        if hit is not None and hit[0] is bucket and hit[1] is buf:
            return hit[2], hit[3]

        def views(runs: tuple[Run, ...]) -> list[torch.Tensor]:
            flat = buf[: bucket.numel].split_with_sizes([r.numel for r in runs])
            return [v.view(r.shape) for v, r in zip(flat, runs, strict=True)]

        packs, unpacks = views(bucket.pack_runs), views(bucket.unpack_runs)
        # The entry holds bucket and buffer, so neither id can be reused while it exists.
        self._views[key] = (bucket, buf, packs, unpacks)
        return packs, unpacks

    def pack(
        self, sources: Mapping[str, torch.Tensor], bucket: Bucket, buf: torch.Tensor
    ) -> torch.Tensor:
        """Copy ``bucket``'s slices of ``sources`` into ``buf``; returns the bucket's part."""
        views, _ = self._buffer_views(bucket, buf)
        srcs = [
            self.source(sources, r.name, r.dim, r.start, r.shape, r.feeds) for r in bucket.pack_runs
        ]
        copy_batched(views, srcs)
        return buf[: bucket.numel]

    def unpack(self, bucket: Bucket, buf: torch.Tensor, dst: Callable[[str], torch.Tensor]) -> None:
        """Copy a received ``bucket`` out of ``buf`` into the destination shards
        (``dst(name)``: this rank's shard ``name``, allocated on first touch)."""
        _, views = self._buffer_views(bucket, buf)
        outs = []
        for r in bucket.unpack_runs:
            t = dst(r.name)
            outs.append(
                t if r.start == 0 and t.shape == r.shape else t.narrow(r.dim, r.start, r.length)
            )
        copy_batched(outs, views)
