"""How a batch becomes micro-batches: ``micro_batch_size`` padded rows, or rows packed end to
end under a token budget (``PackedRows``; the batch contract: docs/architecture-policy.md).

- ``micro_batch_size`` rows, each micro-batch right-padded to its own longest row (the
  default, and what megatron's unfused attention supports);
- or, with ``token_budget``, consecutive rows holding at most that many real tokens, packed
  end to end into one sequence (megatron's ``thd`` format, ``PackedRows``): no compute on
  padding, and short rows share a micro-batch (the dynamic batch size of verl / NeMo-RL).
  Documents attend only within themselves (``policy.attention``, or TE's THD attention) and
  RoPE restarts in each, so log-probs equal the padded ones and a step's gradient does not
  depend on the packing (tests/policy/test_packing.py). ``loss_fn`` still sees padded [n, L] rows:
  the pack's log-probs are scattered back to them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from megatron_grpo.algorithms.step_batch import Rows
from megatron_grpo.config.schema import Config, ConfigError
from megatron_grpo.policy.context_parallel import ZigzagSplit

R = TypeVar("R", bound=Rows)
MicroBatches = Sequence[tuple[slice, int, R, "PackedRows | None"]]
"""(row slice, trimmed length, the rows as a value of the batch's stage, the pack or None)."""


def micro_batch_token_budget(cfg: Config) -> int | None:
    """The token budget of a packed micro-batch without a memory model: an explicit
    ``grpo.batch.micro_batch_tokens``, else (0, or ``auto`` off the GPU) ``micro_batch_size``
    full-length sequences; None when ``grpo.batch.pack_sequences=false`` (``micro_batch_size``
    padded rows). ``auto`` on a GPU is sized by memory: ``dry_run.budget``."""
    g = cfg.grpo
    if not g.batch.pack_sequences:
        return None
    if g.batch.micro_batch_tokens != "auto" and g.batch.micro_batch_tokens:
        return g.batch.micro_batch_tokens
    return g.batch.micro_batch_size * (cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens)


def _row_lengths(batch: Rows) -> list[int]:
    """Each row's length: its last position with ``attention_mask`` 1, plus one (at least 1);
    the full width without a mask."""
    b, seq = batch.input_ids.shape
    if batch.attention_mask is None:
        return [seq] * b
    am = batch.attention_mask != 0
    last = torch.where(am.any(1), seq - am.flip(1).int().argmax(1), 1)
    return last.tolist()


def _slice_rows(batch: R, rows: slice, padded: int) -> R:
    """``batch``'s rows ``rows``, every [B, L, ...] tensor cut (or right-padded) to ``padded``
    positions: with zeros, and ``routed_experts`` with -1 (no expert: the router's own
    choice, and no routing mismatch counted, policy/routing_replay.py)."""
    seq = batch.input_ids.shape[1]

    def cut(name: str, v: torch.Tensor) -> torch.Tensor:
        t = v[rows]
        if t.dim() >= 2 and t.shape[1] == seq:
            t = t[:, :padded]
            if t.shape[1] < padded:  # right padding is invisible to causal attention
                fill = -1 if name == "routed_experts" else 0
                pad = (0, 0) * (t.dim() - 2) + (0, padded - seq)
                t = torch.nn.functional.pad(t, pad, value=fill)
        return t.contiguous()

    return batch.map_rows(cut)


def micro_batches(batch: R, micro_batch_size: int, multiple: int = 1) -> list[tuple[slice, int, R]]:
    """Split ``batch`` into (row slice, trimmed length, micro-batch dict).

    ``multiple``: the micro-batch tensors' length is the trimmed length rounded up to a
    multiple of it, right-padded with zeros past the batch's own length (sequence
    parallelism scatters the sequence dim over tp ranks and needs ``L % tp == 0``,
    megatron/core/tensor_parallel/mappings.py ``_split_along_first_dim``). The returned
    length stays the unpadded one: the positions callers read back.
    """
    b = batch.num_rows
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    lengths = _row_lengths(batch)
    out = []
    for start in range(0, b, micro_batch_size):
        rows = slice(start, min(start + micro_batch_size, b))
        length = max(max(lengths[rows]), 2)
        padded = -(-length // multiple) * multiple
        out.append((rows, length, _slice_rows(batch, rows, padded)))
    return out


@dataclass(frozen=True)
class PackedRows:
    """A micro-batch's rows packed end to end into one sequence (megatron's ``thd`` format).

    Row i contributes its first ``lengths[i]`` tokens as document i; a filler document of
    token 0 follows when the pack must be a multiple of ``multiple`` tokens (sequence
    parallelism). Documents attend only within themselves (``policy.attention``) and RoPE
    restarts at 0 in each (``positions``, ``policy.rope``), so a document's log-probs are
    those it has alone, whatever is packed around it. Everything the device needs is built
    here, on the host, once: the layers read no ``cu_seqlens`` back (``bounds``).
    """

    input_ids: torch.Tensor
    """[1, T] the documents end to end."""
    cu_seqlens: torch.Tensor
    """int32 [documents + 1], filler included."""
    positions: torch.Tensor
    """long [T]: each token's position in its document (RoPE's positions)."""
    bounds: tuple[int, ...]
    """``cu_seqlens`` on the host."""
    max_len: int
    rows: torch.Tensor
    """long [N]: the row of each scored token (positions t >= 1 of every real document)."""
    cols: torch.Tensor
    """long [N]: its position in the row."""
    src: torch.Tensor
    """long [N]: its position in the pack."""
    routed_experts: torch.Tensor | None = None
    """int [T, MoE layers, top-k]: vLLM's experts of each token of the pack, -1 for none
    (the filler, each row's last token); None without routing replay
    (policy/routing_replay.py)."""
    cp_local: torch.Tensor | None = None
    """long [T/cp]: the pack positions this context-parallel rank holds (``split_for``);
    None without context parallelism."""
    cp_stacked: torch.Tensor | None = None
    """long [T]: every CP rank's pack positions, stacked in rank order."""
    cp_order: torch.Tensor | None = None
    """long [T]: the stacked row of each pack position."""
    cp_chunks: tuple[tuple[int, int, int, int], ...] = ()
    """This CP rank's query chunks (``ZigzagSplit.chunks``)."""

    TENSORS = (
        "input_ids", "cu_seqlens", "positions", "rows", "cols", "src", "routed_experts",
        "cp_local", "cp_stacked", "cp_order",
    )  # fmt: skip

    @classmethod
    def build(
        cls, ids: torch.Tensor, lengths: list[int], multiple: int = 1,
        routed: torch.Tensor | None = None, doc_multiple: int = 1,
    ) -> PackedRows:  # fmt: skip
        """``routed``: the rows' [n, L, layers, k] experts, packed like their tokens.
        ``doc_multiple``: every document is padded with token 0 to a multiple of it (context
        parallelism's 2*cp chunks, ``policy.context_parallel``); the padding sits after the
        document's real tokens in its own causal span, so they never see it, and is not
        scored. The filler is then a multiple of both ``multiple`` and ``doc_multiple``."""
        padded = [-(-n // doc_multiple) * doc_multiple for n in lengths]
        docs = [
            torch.nn.functional.pad(ids[i, :n], (0, p - n)) if p > n else ids[i, :n]
            for i, (n, p) in enumerate(zip(lengths, padded))
        ]
        total = sum(padded)
        step = math.lcm(multiple, doc_multiple)
        size = -(-max(total, 2) // step) * step
        doc_lens = list(padded) + ([size - total] if size > total else [])
        if size > total:
            docs.append(ids.new_zeros(size - total))
        starts = [0]
        for n in doc_lens:
            starts.append(starts[-1] + n)
        scored = [(i, n, s) for i, (n, s) in enumerate(zip(lengths, starts)) if n > 1]

        def cat(xs: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(xs) if scored else torch.zeros(0, dtype=torch.long)

        return cls(
            input_ids=torch.cat(docs).unsqueeze(0),
            cu_seqlens=torch.tensor(starts, dtype=torch.int32),
            positions=torch.cat([torch.arange(n) for n in doc_lens if n]),
            bounds=tuple(starts),
            max_len=max(doc_lens),
            rows=cat([torch.full((n - 1,), i) for i, n, _ in scored]),
            cols=cat([torch.arange(1, n) for _, n, _ in scored]),
            src=cat([torch.arange(s + 1, s + n) for _, n, s in scored]),
            routed_experts=None if routed is None else _pack_routed(routed, lengths, starts, size),
        )

    def split_for(self, cp: int, rank: int) -> PackedRows:
        """This pack with context-parallel rank ``rank`` of ``cp``'s share of its tokens
        (``policy.context_parallel.ZigzagSplit``; built with ``doc_multiple=2*cp``)."""
        split = ZigzagSplit(cp, rank, self.bounds)
        local, stacked, order = split.tensors()
        return dataclasses.replace(
            self, cp_local=local, cp_stacked=stacked, cp_order=order, cp_chunks=split.chunks()
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """The pack's tensors by field name (what moves to the device)."""
        return {k: getattr(self, k) for k in self.TENSORS if getattr(self, k) is not None}

    def on(self, moved: dict[str, torch.Tensor]) -> PackedRows:
        """This pack with its tensors replaced by ``moved`` (``tensors()`` on the device)."""
        new = {k: moved[k] for k in self.TENSORS if k in moved}
        return dataclasses.replace(self, **new)  # type: ignore[arg-type]  # tensor fields only

    def packed_seq_params(self, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> Any:
        """megatron's ``PackedSeqParams`` of this pack (its tensors where they are), with two
        attributes the core attention reads (``policy.attention``): ``bounds``, the documents
        on the host, and ``rope``, the pack's (cos, sin) when it applies RoPE itself."""
        from megatron.core.packed_seq_params import PackedSeqParams

        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.max_len,
            max_seqlen_kv=self.max_len,
        )
        params.bounds = self.bounds
        params.rope = rope
        return params

    def unpack(self, packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """[1, T] position-aligned per-token values -> [rows, L]: each document's values at
        its row's positions, 0 at t = 0 and past the document (differentiable). The index
        tensors must be on ``packed``'s device (``on``)."""
        out = packed.new_zeros(shape)
        return out.index_put((self.rows, self.cols), packed[0, self.src])


def _pack_routed(
    routed: torch.Tensor, lengths: list[int], starts: list[int], size: int
) -> torch.Tensor:
    """[n, L, layers, k] -> [size, layers, k]: row i's first ``lengths[i]`` tokens at the
    pack's ``starts[i]``, -1 for the padding and the filler."""
    out = routed.new_full((size, *routed.shape[2:]), -1)
    for i, n in enumerate(lengths):
        out[starts[i] : starts[i] + n] = routed[i, :n]
    return out


def packed_micro_batches(
    batch: R, token_budget: int, multiple: int = 1, cp: int = 1, cp_rank: int = 0
) -> list[tuple[slice, int, R, PackedRows]]:
    """Split ``batch`` into micro-batches of consecutive rows holding at most
    ``token_budget`` real tokens each (a row longer than the budget is a micro-batch of its
    own), packed end to end (``PackedRows``): no compute on padding, and the number of rows
    per micro-batch follows their lengths (verl's / NeMo-RL's dynamic batch size).

    With ``cp`` > 1 every document is padded to a multiple of 2*cp tokens and the pack
    carries context-parallel rank ``cp_rank``'s share (``PackedRows.split_for``); the
    token budget counts real tokens, as without it.

    Returns (row slice, trimmed length, rows dict for ``loss_fn`` [n, length], pack).
    """
    b = batch.num_rows
    if token_budget < 1:
        raise ValueError(f"token_budget={token_budget} must be >= 1")
    lengths = _row_lengths(batch)
    groups, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and tokens + n > token_budget:
            groups.append(slice(start, i))
            start, tokens = i, 0
        tokens += n
    groups.append(slice(start, b))
    out = []
    for rows in groups:
        length = max(lengths[rows])
        routed = None if batch.routed_experts is None else batch.routed_experts[rows]
        pack = _rank_pack(batch.input_ids[rows], lengths[rows], multiple, routed, cp, cp_rank)
        out.append((rows, length, _slice_rows(batch, rows, length), pack))
    return out


def _rank_pack(ids: torch.Tensor, lengths: list[int], multiple: int, routed: torch.Tensor | None,
               cp: int, cp_rank: int) -> PackedRows:  # fmt: skip
    """``PackedRows.build`` of a rank: with ``cp`` > 1 every document padded to a multiple of
    2*cp tokens and the pack cut to context-parallel rank ``cp_rank``'s share, which is then
    the ``multiple`` (sequence parallelism's tp) of tokens: the whole pack one of cp times it."""
    if cp == 1:
        return PackedRows.build(ids, lengths, multiple, routed)
    pack = PackedRows.build(ids, lengths, multiple * cp, routed, doc_multiple=2 * cp)
    return pack.split_for(cp, cp_rank)


def split_batch(
    batch: R,
    micro_batch_size: int,
    token_budget: int | None,
    multiple: int = 1,
    *,
    can_pack: bool = True,
    cp: int = 1,
    cp_rank: int = 0,
) -> MicroBatches[R]:
    """Micro-batches of ``batch``: packed under ``token_budget`` when it is given, else
    ``micro_batch_size`` padded rows (pack None). ``can_pack`` is False under megatron's
    unfused attention, which refuses packed sequences. ``cp`` > 1 (context parallelism)
    splits packs only: ``packed_micro_batches``."""
    if token_budget is None and cp > 1:
        raise ConfigError(
            f"parallel.cp={cp} splits packed micro-batches only, and this batch is cut into "
            "padded rows: set grpo.batch.pack_sequences=true."
        )
    if token_budget is None:
        return [
            (rows, n, mb, None) for rows, n, mb in micro_batches(batch, micro_batch_size, multiple)
        ]
    if not can_pack:
        raise ConfigError(
            "packed micro-batches (a token budget) need the SDPA or Transformer-Engine "
            "attention, but model.local_attention=unfused (megatron's DotProductAttention "
            "refuses packed sequences): set model.local_attention=sdpa or "
            "grpo.batch.pack_sequences=false."
        )
    return packed_micro_batches(batch, token_budget, multiple, cp, cp_rank)


def agreed_count(num_micro_batches: int, group: Any, size: int) -> int:
    """The most micro-batches any rank of ``group`` (``size`` ranks) has: one all-reduce of
    one CPU integer (gloo, also on a GPU run: every group is ``cpu:gloo,cuda:nccl``,
    distributed/setup.py ``process_group_backend``; no device sync), skipped when ``size`` is 1. Expert-parallel ranks run this many, the ones
    with fewer adding empty micro-batches (``empty_micro_batch``): every MoE layer's forward
    and backward is an alltoall over the EP group, so a rank with one micro-batch less would
    leave its peers waiting. Packed micro-batches (a token budget) of per-rank batches
    rarely count alike; megatron-LM pads the count the same way."""
    if size == 1:
        return num_micro_batches
    import torch.distributed as dist

    count = torch.tensor([num_micro_batches])
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return int(count.item())


def empty_micro_batch(
    like: Rows, pack: PackedRows | None, multiple: int = 1, cp: int = 1, cp_rank: int = 0
) -> tuple[Rows, PackedRows | None]:
    """A micro-batch that carries no row, for a rank that runs more micro-batches than it
    has (``agreed_count``): a pack of only the filler document (a ``multiple`` of at least 2
    tokens of token 0) when ``pack`` is given, else one row of them; every token's routed
    experts -1 (the router's own choice, no mismatch counted) where ``like`` carries them.
    The forward step gives it a zero loss (``policy.forward``): it moves the MoE layers'
    alltoalls, not the gradient, nor the metrics. With ``cp`` > 1 the filler is a multiple
    of 2*cp tokens and the pack carries CP rank ``cp_rank``'s share of it, as a real pack
    does (``packed_micro_batches``): the CP ranks' attention gathers its K/V together."""
    size = -(-2 // multiple) * multiple
    ids = like.input_ids.new_zeros(0 if pack is not None else 1, size)
    routed = like.routed_experts
    if routed is not None:
        routed = routed.new_full((ids.shape[0], size, *routed.shape[2:]), -1)
    rows = Rows(input_ids=ids, attention_mask=None, routed_experts=routed)
    if pack is None:
        return rows, None
    return rows, _rank_pack(ids, [], multiple, routed, cp, cp_rank)
