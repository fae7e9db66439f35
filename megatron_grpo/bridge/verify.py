"""Did the weights arrive? Two independent checks of a sync (the anchors' "stale weights go
unnoticed" complaint, DESIGN.md §5).

1. **Checksums**: per destination tensor, what the vLLM rank holds (``ShardReceiver.
   checksums()``, read back in vLLM's logical layout) against what the bridge delivered
   to it, plus a float64 sum for a readable figure. The checksum is the receiver's own
   ``tensor_checksum`` (exact, order-sensitive over the raw bits), so both sides are
   computed the same way.
2. **Logprob parity**: on fixed token sequences, vLLM's prompt logprobs against the
   Megatron policy's logprobs under the weights that were sent; the max absolute
   difference must stay under a tolerance (fp32 CPU kernels: ~1e-5).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from megatron_grpo.bridge.receiver import tensor_checksum


@dataclass(frozen=True)
class TensorChecksum:
    checksum: int
    """``receiver.tensor_checksum``: exact over the raw bits."""
    sum64: float
    """float64 sum, for humans."""
    shape: tuple[int, ...]


def checksum(t: torch.Tensor) -> TensorChecksum:
    return TensorChecksum(
        tensor_checksum(t), float(t.detach().double().sum().item()), tuple(t.shape)
    )


def checksums(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorChecksum]:
    return {name: checksum(t) for name, t in tensors.items()}


@dataclass
class ChecksumReport:
    rank: int
    checked: int = 0
    mismatched: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    """Sent tensors the vLLM rank has no readable value for."""

    @property
    def ok(self) -> bool:
        return self.checked > 0 and not self.mismatched and not self.missing

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def compare_checksums(
    rank: int,
    sent: Mapping[str, TensorChecksum],
    held: Mapping[str, object],
) -> ChecksumReport:
    """``sent``: checksums of the shards delivered to this vLLM rank; ``held``: what the
    rank holds, ``{name: int | TensorChecksum | ParamChecksum-like (.value) | (shape,
    dtype, value)}`` (``ShardReceiver.checksums()`` or ``RolloutEngine.checksums()[i]``)."""
    rep = ChecksumReport(rank)
    for name, s in sent.items():
        h = held.get(name)
        if h is None:
            rep.missing.append(name)
            continue
        value = (
            h if isinstance(h, int)
            else h.checksum if isinstance(h, TensorChecksum)
            else h.value if hasattr(h, "value")
            else h[2]
        )  # fmt: skip
        rep.checked += 1
        if int(value) != s.checksum:
            rep.mismatched.append(name)
    return rep


@dataclass
class ParityReport:
    max_abs_diff: float
    mean_abs_diff: float
    tokens: int
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.tokens > 0 and self.max_abs_diff <= self.tolerance

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def logprob_parity(
    policy_logp: torch.Tensor,
    vllm_logp: Sequence[Sequence[float]],
    lengths: Sequence[int],
    tolerance: float = 1e-4,
) -> ParityReport:
    """Compare the policy's per-token logprobs with vLLM's prompt logprobs.

    ``policy_logp``: [B, L] from ``Policy.compute_logprobs`` (``logp[:, t]`` is the
    logprob of token t given tokens < t, 0 at t = 0; policy/logprob.py ``token_logprobs``);
    ``vllm_logp[b]``: ``RolloutEngine.prompt_logprobs`` (``len - 1`` values, tokens 1..);
    ``lengths[b]``: the true length of sequence b.
    """
    diffs = []
    for b, n in enumerate(lengths):
        ours = policy_logp[b, 1:n].double()
        theirs = torch.tensor(list(vllm_logp[b]), dtype=torch.float64)
        if ours.shape != theirs.shape:
            raise ValueError(
                f"sequence {b}: policy gives {ours.numel()} logprobs, vLLM {theirs.numel()}; "
                "both must score tokens 1..len-1 of the same sequence."
            )
        diffs.append((ours - theirs).abs())
    d = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)
    return ParityReport(
        max_abs_diff=float(d.max()) if d.numel() else float("inf"),
        mean_abs_diff=float(d.mean()) if d.numel() else float("inf"),
        tokens=int(d.numel()),
        tolerance=tolerance,
    )


def fixed_sequences(
    vocab_size: int, n: int = 4, length: int = 12, seed: int = 0
) -> list[list[int]]:
    """Deterministic token sequences for parity checks (ids in [3, vocab) to skip specials)."""
    g = torch.Generator().manual_seed(seed)
    hi = max(4, min(vocab_size, 1000))
    return [torch.randint(3, hi, (length - (i % 3),), generator=g).tolist() for i in range(n)]


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """``{"input_ids", "attention_mask"}`` right-padded, for ``Policy.compute_logprobs``."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(list(s))
        mask[i, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask}
