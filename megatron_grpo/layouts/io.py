"""Move whole models between HF safetensors and a (TP, PP, VPP, EP) sharded Megatron GPTModel.

- :func:`load_hf_into_megatron`: every rank reads only the HF slices of its own shards,
  straight from the memory-mapped safetensors files (``safe_open(...).get_slice``), one
  parameter at a time: no rank ever holds a full copy of the model.
- :func:`iter_hf_tensors` / :func:`gather_hf_state_dict`: rebuild full HF tensors on one
  rank from the shards of the DP-replica-0 ranks, one decoder layer at a time (point to
  point sends over the default process group, so it works with gloo and NCCL).

Both take the model chunks (one per virtual pipeline stage, in vp_stage order; DDP /
Float16Module wrappers allowed) and ``ctx``: any object with ``tp``, ``pp``, ``tp_rank``,
``pp_rank``, ``dp_rank`` (and optionally ``vpp``, ``dp``, ``ep``, ``ep_rank``) -- the runtime's
``ParallelContext`` or, without a runtime, :class:`RankInfo`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_grpo.layouts import hf
from megatron_grpo.layouts import megatron as mg
from megatron_grpo.layouts.pieces import ShardLayout, assemble, scatter
from megatron_grpo.models.spec import ModelSpec


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the trainer without a ``ParallelContext`` (tests, tools): the
    trainer's layout and this rank's coordinates in it, read under the context's names."""

    layout: mg.MegatronLayout = mg.MegatronLayout()
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    ep_rank: int = 0

    tp = property(lambda self: self.layout.tp)
    ep = property(lambda self: self.layout.ep)
    pp = property(lambda self: self.layout.pp)
    vpp = property(lambda self: self.layout.vpp)
    dp = property(lambda self: self.layout.dp)


class CheckpointError(ValueError):
    """An HF checkpoint directory is missing, truncated or does not match its config."""


# ---------------------------------------------------------------------------------------
# HF safetensors reading
# ---------------------------------------------------------------------------------------


class HFCheckpointReader:
    """Slices of HF tensors from ``model.safetensors`` or sharded files + index.json.

    Files are opened lazily with ``safe_open`` (memory-mapped); ``read`` materialises only
    the requested slice.
    """

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from e
            self.file_of = {k: self.dir / v for k, v in weight_map.items()}
        elif single.is_file():
            self.file_of = {k: single for k in self._keys(single)}
        else:
            raise CheckpointError(
                f"{self.dir} has neither model.safetensors nor model.safetensors.index.json: "
                "point --hf/model.hf_path at a Hugging Face model directory saved with safetensors."
            )
        self._handles: dict[Path, object] = {}

    @staticmethod
    def _keys(path: Path) -> list[str]:
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                return list(f.keys())
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(
                f"{path}: cannot read safetensors header ({e}); is it truncated?"
            ) from e

    def _handle(self, path: Path):
        from safetensors import safe_open

        h = self._handles.get(path)
        if h is None:
            if not path.is_file():
                raise CheckpointError(f"{path} is listed in the index but missing")
            try:
                h = safe_open(str(path), framework="pt")
            except Exception as e:
                raise CheckpointError(f"{path}: cannot open ({e}); is it truncated?") from e
            self._handles[path] = h
        return h

    def names(self) -> list[str]:
        return list(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        return self._slice(name).get_dtype()

    def _slice(self, name: str):
        path = self.file_of.get(name)
        if path is None:
            raise CheckpointError(f"HF tensor {name!r} is missing from {self.dir}")
        return self._handle(path).get_slice(name)

    def read(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        """``tensor[name].narrow(dim, start, length)``, reading only those bytes."""
        sl = self._slice(name)
        index = tuple([slice(None)] * dim + [slice(start, start + length)])
        try:
            return sl[index]
        except Exception as e:
            raise CheckpointError(
                f"{self.file_of[name]}: reading {name!r}[{start}:{start + length}] along dim "
                f"{dim} failed ({e}); is the file truncated?"
            ) from e

    def check_shapes(self, spec: ModelSpec) -> None:
        """Raise naming the first tensor whose shape disagrees with config.json, or which is
        missing. Extra tensors are ignored only when they are a tied ``lm_head.weight``."""
        for name, shape in hf.hf_shapes(spec).items():
            got = self.shape(name)
            if got != shape:
                raise CheckpointError(
                    f"{self.file_of[name]}: {name} has shape {got}, config.json implies {shape}"
                )
        known = set(hf.hf_shapes(spec))
        extra = [n for n in self.file_of if n not in known and n != hf.LM_HEAD]
        extra = [n for n in extra if not n.endswith("rotary_emb.inv_freq")]
        if extra:
            raise CheckpointError(
                f"{self.dir}: tensors {extra[:5]} are not part of a {spec.family} model with "
                f"{spec.num_layers} layers; is config.json the right one?"
            )


# ---------------------------------------------------------------------------------------
# Model inspection
# ---------------------------------------------------------------------------------------


def _chunks(model_chunks) -> list[torch.nn.Module]:
    if isinstance(model_chunks, torch.nn.Module):
        return [model_chunks]
    return list(model_chunks)


def _local_params(chunk: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {mg.strip_wrappers(n): p for n, p in chunk.named_parameters()}


def megatron_layout_of(model_chunks, spec: ModelSpec, ctx) -> mg.MegatronLayout:
    """The :class:`MegatronLayout` of a built model: sizes from ``ctx``, norm naming and
    padded vocabulary read from the model's actual parameters."""
    chunks = _chunks(model_chunks)
    names: list[str] = []
    vocab_rows = None
    for c in chunks:
        for n, p in _local_params(c).items():
            names.append(n)
            if n in (mg.EMBEDDING, mg.OUTPUT):
                vocab_rows = p.shape[0]
    # A middle pipeline stage holds no vocabulary rows: it keeps padded_vocab=None (the
    # default rule); iter_hf_tensors agrees on the real value across ranks.
    padded = vocab_rows * ctx.tp if vocab_rows is not None else None
    ml = mg.MegatronLayout.of(ctx, names, padded)
    if len(chunks) != ml.vpp:
        raise ValueError(f"got {len(chunks)} model chunks but ctx.vpp={ml.vpp}")
    mg.validate(spec, ml)
    return ml


# ---------------------------------------------------------------------------------------
# HF -> Megatron
# ---------------------------------------------------------------------------------------


@torch.no_grad()
def load_hf_into_megatron(model_chunks, hf_dir: str | Path, spec: ModelSpec, ctx) -> None:
    """Fill every parameter of this rank's model chunks from the HF checkpoint ``hf_dir``.

    Each parameter is built from its HF slices (read through the safetensors memory map)
    and copied in; Megatron's vocabulary padding rows become zero. Raises naming the
    parameter when the model has a parameter the layouts do not know, a shape that
    disagrees with the layout, or when a parameter the layout expects is absent.
    Call it before the optimizer is built (fp32 main params copy the model at creation).
    """
    chunks = _chunks(model_chunks)
    ml = megatron_layout_of(chunks, spec, ctx)
    reader = HFCheckpointReader(hf_dir)
    for vp_stage, chunk in enumerate(chunks):
        params = _local_params(chunk)
        expected = mg.chunk_names(spec, ml, ctx.pp_rank, vp_stage)
        missing = [n for n in expected if n not in params]
        if missing:
            raise mg.UnknownParameterError(
                f"model chunk (pp_rank={ctx.pp_rank}, vp_stage={vp_stage}) lacks {missing[:4]}: "
                "it was not built for this spec/layout"
            )
        for name, p in params.items():
            layout = mg.shard(spec, ml, name, ctx.pp_rank, vp_stage, ctx.tp_rank, _ep_rank(ctx))
            if tuple(p.shape) != layout.shape:
                raise ValueError(
                    f"Megatron parameter {name} has shape {tuple(p.shape)}, the layout for "
                    f"tp={ml.tp} expects {layout.shape}"
                )
            if p.device.type == "cpu" and p.is_contiguous():
                assemble(layout, reader.read, out=p.data)
            else:
                p.data.copy_(assemble(layout, reader.read, dtype=p.dtype))


# ---------------------------------------------------------------------------------------
# Megatron -> HF
# ---------------------------------------------------------------------------------------


def _ep_rank(ctx) -> int:
    return getattr(ctx, "ep_rank", 0)


@dataclass(frozen=True)
class _Source:
    group: int
    """0 = embedding, 1 + i = decoder layer i, L + 1 = final norm + lm_head."""
    pp_rank: int
    vp_stage: int
    tp_rank: int
    layout: ShardLayout
    ep_rank: int = 0
    """The EP rank holding an expert shard; 0 for the shards every EP rank holds."""


def _group_of(layout: ShardLayout, num_layers: int) -> int:
    src = layout.hf_names[0]
    layer = hf.hf_layer_of(src)
    if layer is not None:
        return 1 + layer
    return 0 if src == hf.EMBED and layout.name == mg.EMBEDDING else num_layers + 1


def gather_schedule(spec: ModelSpec, ml: mg.MegatronLayout) -> list[_Source]:
    """Every shard the gather moves, grouped by HF group, deduplicated: TP-replicated
    tensors (norms) come from TP rank 0 only, EP-replicated ones (all but the experts) from
    EP rank 0 only; a tied output layer is skipped."""
    out: list[_Source] = []
    for pp_rank in range(ml.pp):
        for vp in range(ml.vpp):
            names = mg.chunk_names(spec, ml, pp_rank, vp)
            for tp_rank, ep_rank, n in (
                (t, e, n) for t in range(ml.tp) for e in range(ml.ep) for n in names
            ):
                if (n == mg.OUTPUT and spec.tie_word_embeddings) or (
                    ep_rank > 0 and not mg.is_expert(n)
                ):
                    continue
                lay = mg.shard(spec, ml, n, pp_rank, vp, tp_rank, ep_rank)
                if not lay.hf_names:  # a vocabulary shard of padding rows only
                    continue
                first = mg.shard(spec, ml, n, pp_rank, vp, 0, ep_rank)
                if tp_rank > 0 and lay.pieces == first.pieces:
                    continue
                group = _group_of(lay, spec.num_layers)
                out.append(_Source(group, pp_rank, vp, tp_rank, lay, ep_rank))
    out.sort(key=lambda s: s.group)  # stable: keeps (pp, vp, tp, name) order inside a group
    return out


def _group_hf_names(spec: ModelSpec, group: int) -> dict[str, tuple[int, ...]]:
    shapes = hf.hf_shapes(spec)
    if group == 0:
        return {hf.EMBED: shapes[hf.EMBED]}
    if group <= spec.num_layers:
        return hf.hf_layer_shapes(spec, group - 1)
    return {n: s for n, s in shapes.items() if n in (hf.FINAL_NORM, hf.LM_HEAD)}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_table(
    ctx, dtype: torch.dtype, padded_vocab: int | None
) -> tuple[dict[tuple[int, int, int], int], dict[int, torch.dtype], int | None]:
    """Exchange every rank's coordinates: (ep_rank, pp_rank, tp_rank) -> the global rank of
    the lowest DP replica there (DP replica 0 for ep_rank 0, since EP ranks are a sub-axis of
    DP), each rank's parameter dtype, and the padded vocabulary (known to the stages holding
    it)."""
    # Context-parallel ranks hold the same weights as cp_rank 0; only those are sources.
    cp_rank = getattr(ctx, "cp_rank", 0)
    me = (ctx.dp_rank, ctx.pp_rank, ctx.tp_rank, str(dtype).split(".")[-1], padded_vocab, cp_rank,
          _ep_rank(ctx))  # fmt: skip
    if _distributed():
        allv: list = [None] * dist.get_world_size()
        dist.all_gather_object(allv, me)
    else:
        allv = [me]
    table: dict[tuple[int, int, int], int] = {}
    for r, v in sorted(enumerate(allv), key=lambda rv: -rv[1][0]):  # lowest dp_rank last
        if v[5] == 0:
            table[(v[6], v[1], v[2])] = r
    dtypes = {r: getattr(torch, v[3]) for r, v in enumerate(allv)}
    vocabs = {v[4] for v in allv if v[4] is not None}
    if len(vocabs) > 1:
        raise ValueError(f"ranks disagree on the padded vocabulary: {sorted(vocabs)}")
    return table, dtypes, (vocabs.pop() if vocabs else None)


@torch.no_grad()
def iter_hf_tensors(
    model_chunks, spec: ModelSpec, ctx, dst_rank: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full CPU tensor)`` on ``dst_rank`` in checkpoint order, one
    group (embedding, each layer, final norm + lm_head) at a time.

    Every rank must iterate it to the end (non-destination ranks send and yield nothing).
    Memory on ``dst_rank``: one group's HF tensors plus one shard.
    """
    chunks = _chunks(model_chunks)
    ml = megatron_layout_of(chunks, spec, ctx)
    local = [_local_params(c) for c in chunks]
    first_param = next(p for params in local for p in params.values())
    table, dtypes, padded = _rank_table(ctx, first_param.dtype, ml.padded_vocab)
    me = dist.get_rank() if _distributed() else 0
    ml = replace(ml, padded_vocab=padded)
    sched = gather_schedule(spec, ml)
    full: dict[str, torch.Tensor] = {}
    group = -1
    for src in sched:
        if src.group != group:
            if me == dst_rank and group >= 0:
                yield from _emit(spec, group, full)
            group = src.group
            if me == dst_rank:
                full = {
                    n: torch.zeros(s, dtype=dtypes[table[(0, src.pp_rank, src.tp_rank)]])
                    for n, s in _group_hf_names(spec, group).items()
                }
        owner = table[(src.ep_rank, src.pp_rank, src.tp_rank)]
        if me != owner and me != dst_rank:
            continue
        if me == owner:
            t = local[src.vp_stage][src.layout.name]
            if tuple(t.shape) != src.layout.shape:
                raise ValueError(
                    f"{src.layout.name}: shape {tuple(t.shape)} != layout {src.layout.shape}"
                )
            if me == dst_rank:
                scatter(src.layout, t.detach().cpu(), full)
            else:
                dist.send(t.detach().contiguous(), dst_rank)
        else:  # me == dst_rank, receive from owner
            buf = torch.empty(src.layout.shape, dtype=dtypes[owner], device=first_param.device)
            dist.recv(buf, owner)
            scatter(src.layout, buf.cpu(), full)
    if me == dst_rank and group >= 0:
        yield from _emit(spec, group, full)


def _emit(spec: ModelSpec, group: int, full: dict[str, torch.Tensor]):
    for n in _group_hf_names(spec, group):
        yield n, full[n]


def gather_hf_state_dict(
    model_chunks, spec: ModelSpec, ctx, dst_rank: int = 0
) -> dict[str, torch.Tensor]:
    """Full HF state dict on ``dst_rank`` (empty dict elsewhere); call on every rank."""
    return dict(iter_hf_tensors(model_chunks, spec, ctx, dst_rank))
