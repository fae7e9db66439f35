"""Did the weights arrive? Two independent checks of a sync (the anchors' "stale weights go
unnoticed" complaint, docs/bridge.md "Why a bridge").

1. **Checksums**: per destination tensor, what the vLLM rank holds (``ShardReceiver.
   checksums()``, read back in vLLM's logical layout) against what the bridge delivered
   to it. Both sides use ``bridge.checksum`` (exact, order-sensitive over the raw bits).
2. **Logprob parity**: on fixed token sequences, vLLM's prompt logprobs against the
   Megatron policy's logprobs under the weights that were sent; the max absolute
   difference must stay under a tolerance (fp32 CPU kernels: ~1e-5).

:func:`verify_sync` runs both after a training sync when ``sync.verify=true``
(``bridge.weight_sync``); the trainer logs its figures in metrics.jsonl and a failed check
raises :class:`SyncVerificationError` on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from megatron_grpo.algorithms.step_batch import Rows
from megatron_grpo.bridge.checksum import Checksum


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
    sent: Mapping[str, Checksum],
    held: Mapping[str, int | Checksum | tuple[Any, Any, int]],
) -> ChecksumReport:
    """``sent``: checksums of the shards delivered to this vLLM rank; ``held``: what the
    rank holds, ``{name: int | Checksum | (shape, dtype, value)}``
    (``ShardReceiver.checksums()`` or ``RolloutEngine.checksums()[i]``)."""
    rep = ChecksumReport(rank)
    for name, s in sent.items():
        h = held.get(name)
        if h is None:
            rep.missing.append(name)
            continue
        value = h if isinstance(h, int) else h.value if isinstance(h, Checksum) else h[2]
        rep.checked += 1
        if int(value) != s.value:
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


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int = 0) -> Rows:
    """``input_ids`` and ``attention_mask`` right-padded, for ``Policy.compute_logprobs``."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(list(s))
        mask[i, : len(s)] = 1
    return Rows(input_ids=ids, attention_mask=mask)


PARITY_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3}
"""Max |policy - vLLM| prompt log-prob allowed by ``sync.verify`` per parameter dtype; half
precision gets ``HALF_PARITY_TOLERANCE`` (different kernels round differently). One
optimizer step of a small model moves log-probs by more than 1e-3, so stale weights fail."""
HALF_PARITY_TOLERANCE = 0.25


class SyncVerificationError(RuntimeError):
    """``sync.verify`` found the weights vLLM serves differ from those sent."""


def verify_sync(ctx, policy, engine, sent: Mapping[str, Checksum] | None) -> dict:
    """Both checks after a sync, collective over the job; returns metrics for metrics.jsonl.

    ``sent``: the checksums of what the bridge delivered to this rank's vLLM receiver (None:
    the baseline path, which loads through vLLM's ``load_weights``; only parity then).
    Parity runs at T=1 (vLLM's prompt log-probs are raw) on :func:`fixed_sequences`.
    Raises :class:`SyncVerificationError` on every rank when either check fails anywhere.
    """
    import torch.distributed as dist

    out: dict = {}
    world = ctx.world_size if dist.is_initialized() else 1
    bad: list[str] = []
    if sent is not None:
        rep = compare_checksums(ctx.rank, sent, engine.receiver.checksums())
        reps = [rep]
        if world > 1:
            reps = [rep] * world  # placeholders, each overwritten by its rank's report
            dist.all_gather_object(reps, rep)
        out["verify_checksums_checked"] = sum(r.checked for r in reps)
        out["verify_checksums_ok"] = all(r.ok for r in reps)
        for r in reps:
            if not r.ok:
                names = (r.mismatched + r.missing)[:3] or ["nothing checked"]
                bad.append(f"rank {r.rank} checksums differ/missing for {names}")
    seqs = fixed_sequences(policy.vocab_size)
    with policy.at_temperature(1.0):
        logp = policy.compute_logprobs(pad_batch(seqs), micro_batch_size=len(seqs))["logp"]
    dtype = next(p for _, p in policy.named_shards()).dtype
    tol = PARITY_TOLERANCE.get(dtype, HALF_PARITY_TOLERANCE)
    par = logprob_parity(logp, engine.prompt_logprobs(seqs), [len(s) for s in seqs], tol)
    worst = torch.tensor([par.max_abs_diff], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    out["verify_parity_max_abs_diff"] = float(worst)
    out["verify_parity_ok"] = bool(float(worst) <= tol)
    if not out["verify_parity_ok"]:
        bad.append(f"prompt log-probs differ by {float(worst):.3g} > {tol:g}")
    if bad:
        raise SyncVerificationError(
            f"sync.verify: vLLM does not serve the weights just sent ({'; '.join(bad)}); the "
            "bridge or the engine's reload is broken: run `megatron-grpo bench sync` on this "
            "layout, or set sync.verify=false to train anyway."
        )
    return out
