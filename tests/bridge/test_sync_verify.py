"""``sync.verify``: the checks after each sync raise on a mismatch and report figures.

Fakes stand in for the policy and the engine (the real path runs in tests/e2e/test_trainer.py's
golden runs, which train with sync.verify=true)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from megatron_grpo.bridge.checksum import checksum
from megatron_grpo.bridge.verify import SyncVerificationError, fixed_sequences, verify_sync


class FakePolicy:
    vocab_size = 50

    def __init__(self, shift: float = 0.0) -> None:
        self.shift, self.temperature = shift, 0.5
        self.seen_temperature = None

    @contextlib.contextmanager
    def at_temperature(self, t):
        saved, self.temperature = self.temperature, t
        yield self
        self.temperature = saved

    def named_shards(self):
        yield "w", torch.zeros(2)

    def compute_logprobs(self, batch, micro_batch_size):
        self.seen_temperature = self.temperature
        ids = batch.input_ids.double()
        return {"logp": -ids / 100 + self.shift}


class FakeEngine:
    def __init__(self, held: dict) -> None:
        self.receiver = SimpleNamespace(checksums=lambda: held)

    def prompt_logprobs(self, seqs):
        return [[-t / 100 for t in s[1:]] for s in seqs]


CTX = SimpleNamespace(rank=0, world_size=1)


def test_verify_reports_figures_and_scores_at_temperature_one():
    w = torch.arange(4.0)
    sent = {"w": checksum(w)}
    policy = FakePolicy()
    out = verify_sync(CTX, policy, FakeEngine({"w": checksum(w)}), sent)
    assert out["verify_checksums_ok"] and out["verify_checksums_checked"] == 1
    assert out["verify_parity_ok"] and out["verify_parity_max_abs_diff"] < 1e-12
    # vLLM's prompt log-probs are raw T=1 values: the policy is scored at T=1, then restored.
    assert policy.seen_temperature == 1.0 and policy.temperature == 0.5
    assert len(fixed_sequences(50)) == 4


def test_verify_raises_on_checksum_mismatch_or_missing():
    w = torch.arange(4.0)
    with pytest.raises(SyncVerificationError, match="checksums differ/missing for \\['w'\\]"):
        verify_sync(CTX, FakePolicy(), FakeEngine({"w": checksum(w + 1)}), {"w": checksum(w)})
    with pytest.raises(SyncVerificationError, match="'w'"):
        verify_sync(CTX, FakePolicy(), FakeEngine({}), {"w": checksum(w)})


def test_verify_raises_on_logprob_parity():
    # A policy 0.01 nats off vLLM (stale weights) exceeds fp32's 1e-3 tolerance.
    with pytest.raises(SyncVerificationError, match="prompt log-probs differ by 0.01"):
        verify_sync(CTX, FakePolicy(shift=0.01), FakeEngine({}), None)
