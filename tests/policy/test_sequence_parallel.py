"""Sequence parallelism on the local spec (``policy/model_builder.py`` ``LocalRMSNorm``), on
CPU: the norms and residuals of each layer hold ``1/tp`` of the tokens, megatron's linear
layers all-gather and reduce-scatter the sequence around attention and the MLP, and the
norms' weight gradients are summed over TP (``finalize_model_grads``).

- The norm builder marks its weight ``sequence_parallel`` only under sequence parallelism.
- Spawned gloo ranks, fp32, the tiny model: at TP=2 with sequence parallelism, the log-probs,
  entropies, loss, grad norm, every gradient and the updated weights equal TP=2 without it,
  for padded rows (each micro-batch padded to a multiple of tp) and for packs; and with
  context parallelism too (TP=2 x CP=2, 4 ranks), the pack split over the CP ranks and each
  rank's share over the TP ranks (issue 42: "TP with and without sequence parallelism").
- The tiny MoE trains at TP=2 with sequence parallelism (megatron's MoE layer refuses TP
  without it): log-probs, loss, grad norm and the log-probs after the step equal TP=1, with
  the router's own choice and with routing replay. The dense runs score through the fused
  path (``model.logprob_impl=auto``), this one through the logits: both of
  ``policy/scoring.py``'s sequence-parallel gathers run.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from megatron_grpo.policy.micro_batches import packed_micro_batches
from tests.dist_utils import run_distributed
from tests.policy.test_context_parallel import TOL, _batch, _policy_worker, pg_loss


def test_the_local_norm_asks_for_the_tp_all_reduce_only_under_sequence_parallelism():
    from megatron_grpo.policy.model_builder import LocalRMSNorm

    plain = LocalRMSNorm(SimpleNamespace(sequence_parallel=False), hidden_size=8, eps=1e-6)
    sp = LocalRMSNorm(SimpleNamespace(sequence_parallel=True), hidden_size=8, eps=1e-6)
    assert type(plain) is torch.nn.RMSNorm and type(sp) is torch.nn.RMSNorm  # kernels swap it
    assert plain.eps == 1e-6 and plain.weight.shape == (8,)
    assert not getattr(plain.weight, "sequence_parallel", False)
    assert sp.weight.sequence_parallel is True


@pytest.mark.parametrize("tp,cp", [(2, 1), (4, 2), (2, 4), (3, 2)])
@pytest.mark.parametrize("lengths", [(14, 6, 10, 1, 9, 3), (3,), (5, 2)])
def test_a_packs_share_is_a_multiple_of_tp_on_every_cp_rank(tp, cp, lengths):
    batch = _batch(100, lengths)
    for r in range(cp):
        for _, _, _, pack in packed_micro_batches(batch, 25, multiple=tp, cp=cp, cp_rank=r):
            local = pack.cp_local
            n = pack.input_ids.shape[1] if local is None else local.numel()
            assert n % tp == 0, (tp, cp, r, n)


def _padded_and_packed(rank, world, tp, cp, hf_dir, sp):
    """``_policy_worker`` for padded rows (no token budget; not at CP > 1, which packs) and
    for packs (budget 25), one after the other on the same ranks."""
    return _policy_worker(rank, world, tp, cp, hf_dir, (25,) if cp > 1 else (None, 25), sp=sp)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    from megatron_grpo.models.tiny import build_hf_model

    d = tmp_path_factory.mktemp("sp") / "tiny"
    build_hf_model(d, "tiny", seed=3)
    return str(d)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sequence_parallel_equals_tp_alone_with_and_without_cp(hf_dir):
    ref = {r[25]["tp_rank"]: r for r in run_distributed(_padded_and_packed, 2, 2, 1, hf_dir, False,
                                                        timeout=280)}  # fmt: skip
    sp = run_distributed(_padded_and_packed, 2, 2, 1, hf_dir, True, timeout=280)
    sp_cp = run_distributed(_padded_and_packed, 4, 2, 2, hf_dir, True, timeout=280)
    compared = 0
    for run in (sp, sp_cp):
        for by_budget in run:
            for budget, got in by_budget.items():
                want = ref[got["tp_rank"]][budget]
                assert want["logp"].abs().max() > 0.1
                for key in ("logp", "entropy"):
                    torch.testing.assert_close(got[key], want[key], atol=TOL, rtol=0)
                assert got["loss"] == pytest.approx(want["loss"], abs=1e-6)
                assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
                scale = max(g.abs().max().item() for g in want["grads"].values())
                norms = [n for n in want["grads"] if "layernorm" in n]
                assert norms  # the norms' gradients, summed over the TP ranks' tokens
                for n, g in want["grads"].items():
                    assert (got["grads"][n] - g).abs().max().item() <= 1e-5 * scale, n
                for n, w in want["weights"].items():
                    assert (got["weights"][n] - w).abs().max().item() <= 1e-6, n
                compared += 1
    assert compared == 2 * 2 + 4  # TP=2 SP: both ranks, padded and packed; TP=2 x CP=2: 4 ranks


def _moe_worker(rank, world, tp, hf_dir):
    """The tiny MoE at TP=tp (with sequence parallelism when tp > 1): per routing replay
    off/on, one step's log-probs, loss and grad norm, and the log-probs after it."""
    from megatron_grpo.config.schema import ModelConfig, OptimConfig, ParallelConfig
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.layouts import load_hf_into_megatron
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.policy import build_policy
    from tests.policy.test_moe_packing import BUDGET, LENGTHS, _rank_batch

    spec = load_spec(hf_dir)
    par = ParallelConfig(tp=tp, sequence_parallel=tp > 1)
    with distributed_context(par, spec, seed=1) as ctx:
        batch = _rank_batch(spec.vocab_size, spec.num_layers, 0)
        loss_fn = partial(pg_loss, n_tokens=float(sum(n - 2 for n in LENGTHS[0])))
        out = {}
        for replay in (False, True):
            policy = build_policy(
                spec, ctx, ModelConfig(logprob_impl="logits"),
                OptimConfig(lr=1e-2, clip_grad=0.0, adam_eps=1e-1),
                init_weights=lambda ch: load_hf_into_megatron(ch, hf_dir, spec, ctx),
                routing_replay=replay,
            )  # fmt: skip
            lp = policy.compute_logprobs(batch, 2, token_budget=BUDGET)
            metrics = policy.train_step(batch, loss_fn, 2, token_budget=BUDGET)
            after = policy.compute_logprobs(batch, 2, token_budget=BUDGET)
            out[replay] = {"logp": lp["logp"], "after": after["logp"], "loss": metrics["loss"],
                           "grad_norm": metrics["grad_norm"]}  # fmt: skip
        return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_moe_trains_at_tp2_with_sequence_parallelism(tmp_path_factory):
    from megatron_grpo.models.tiny import build_hf_model

    moe = str(build_hf_model(tmp_path_factory.mktemp("sp_moe") / "m", "tiny-moe", seed=3))
    (want,) = run_distributed(_moe_worker, 1, 1, moe, timeout=280)
    for got in run_distributed(_moe_worker, 2, 2, moe, timeout=280):
        for replay in (False, True):
            g, w = got[replay], want[replay]
            assert (w["after"] - w["logp"]).abs().max() > 1e-3  # the step moved the policy
            for key in ("logp", "after"):
                torch.testing.assert_close(g[key], w[key], atol=TOL, rtol=0)
            assert g["loss"] == pytest.approx(w["loss"], abs=1e-6)
            assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5)
