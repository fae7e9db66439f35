"""Packed micro-batches under a token budget (``policy/micro_batches.py`` ``packed_micro_batches``).

- Splitting: consecutive rows up to the budget, a row longer than the budget alone, the pack
  padded to a multiple of tp with a filler document, and ``PackedRows.unpack`` putting every
  document's values back at its row's positions.
- Model level at (tp, pp) in {(1,1), (2,1), (1,2)} (spawned gloo ranks, fp32): packed
  log-probs and entropies equal the padded ones (<= 1e-5) for several budgets, and one
  train step's gradient does not depend on how the rows were packed: padded rows, packs of
  a few rows and one pack of the whole batch give the same gradient and the same updated
  weights.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from megatron_grpo.policy.micro_batches import PackedRows, packed_micro_batches
from tests.dist_utils import run_distributed
from tests.helpers.batches import advantaged

LOGP_TOL = 1e-5


def _batch(vocab: int, lengths=(14, 6, 10, 1, 9, 3), width: int = 16):
    g = torch.Generator().manual_seed(0)
    b = len(lengths)
    ids = torch.zeros(b, width, dtype=torch.long)
    attn = torch.zeros(b, width)
    loss_mask = torch.zeros(b, width)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, vocab, (n,), generator=g)
        attn[i, :n] = 1
        loss_mask[i, 2:n] = 1  # the first 2 tokens are the "prompt"
    adv = torch.linspace(-1.0, 1.5, b)
    return advantaged(ids, attention_mask=attn, loss_mask=loss_mask, advantages=adv)


def test_rows_are_grouped_by_token_budget():
    batch = _batch(50)
    mbs = packed_micro_batches(batch, token_budget=16)
    # lengths 14 | 6 10 | 1 9 3 : consecutive rows while the real tokens fit the budget
    assert [(rows, n) for rows, n, _, _ in mbs] == [
        (slice(0, 1), 14), (slice(1, 3), 10), (slice(3, 6), 9),
    ]  # fmt: skip
    rows, n, mb, pack = mbs[2]
    assert mb.input_ids.shape == (3, 9) and mb.advantages.tolist() == batch.advantages[3:6].tolist()
    assert pack.input_ids.shape == (1, 13) and pack.cu_seqlens.tolist() == [0, 1, 10, 13]
    expect = torch.cat([batch.input_ids[3, :1], batch.input_ids[4, :9], batch.input_ids[5, :3]])
    assert torch.equal(pack.input_ids[0], expect)
    # a row longer than the budget is a micro-batch of its own
    assert [rows for rows, *_ in packed_micro_batches(batch, token_budget=5)][:2] == [
        slice(0, 1), slice(1, 2),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="token_budget=0"):
        packed_micro_batches(batch, token_budget=0)


def test_pack_is_padded_to_a_multiple_with_a_filler_document():
    ids = torch.arange(1, 13).view(2, 6)
    pack = PackedRows.build(ids, [5, 2], multiple=4)
    assert pack.input_ids.shape == (1, 8)
    assert pack.cu_seqlens.tolist() == [0, 5, 7, 8] and pack.max_len == 5
    assert pack.input_ids[0].tolist() == [1, 2, 3, 4, 5, 7, 8, 0]


def test_unpack_puts_each_document_back_at_its_row():
    ids = torch.arange(1, 13).view(2, 6)
    pack = PackedRows.build(ids, [4, 3])
    values = torch.arange(7.0).view(1, 7).requires_grad_(True)
    out = pack.unpack(values, (2, 6))
    # t = 0 of each document has no prediction (0); positions past a document are 0
    assert out.tolist() == [[0, 1, 2, 3, 0, 0], [0, 5, 6, 0, 0, 0]]
    out.sum().backward()
    assert values.grad.tolist() == [[0, 1, 1, 1, 0, 1, 1]]


# ------------------------------------------------------------------ model level


def pg_loss(logp, entropy, mb, *, n_tokens: float):
    mask = mb.loss_mask
    loss = -(mb.advantages[:, None] * logp * mask).sum() / n_tokens
    loss = loss - 0.01 * (entropy * mask).sum() / n_tokens
    return loss, {"tokens": mask.sum()}


PACKINGS = {"padded": None, "budget16": 16, "budget25": 25, "one_pack": 1000}


def _packing_worker(rank, world_size, tp, pp, hf_dir):
    from megatron_grpo.config.schema import ModelConfig, OptimConfig, ParallelConfig
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.layouts import load_hf_into_megatron
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.policy import build_policy

    spec = load_spec(hf_dir)
    with distributed_context(ParallelConfig(tp=tp, pp=pp), spec, seed=1) as ctx:
        batch = _batch(spec.vocab_size)
        loss_fn = partial(pg_loss, n_tokens=float(batch.loss_mask.sum()))
        out = {"logp": {}, "grads": {}, "weights": {}, "loss": {}}
        for name, budget in PACKINGS.items():
            policy = build_policy(
                spec, ctx, ModelConfig(),
                # adam_eps well above the gradients keeps the update ~ lr*g/eps: linear in
                # the gradient, so updated weights compare gradients, not their signs.
                OptimConfig(lr=1e-2, clip_grad=0.0, adam_eps=1e-1),
                init_weights=lambda ch: load_hf_into_megatron(ch, hf_dir, spec, ctx),
            )  # fmt: skip
            before = {n: p.detach().clone() for n, p in policy.named_shards()}
            lp = policy.compute_logprobs(batch, 2, token_budget=budget)
            out["logp"][name] = (lp["logp"], lp["entropy"])
            metrics = policy.train_step(batch, loss_fn, 2, token_budget=budget)
            out["loss"][name] = metrics["loss"]
            out["grads"][name] = {
                n: p.main_grad.clone() for n, p in policy.models[0].named_parameters()
            }
            out["weights"][name] = {n: p.detach().clone() for n, p in policy.named_shards()}
            out.setdefault("moved", {})[name] = max(
                (p - before[n]).abs().max().item() for n, p in policy.named_shards()
            )
        return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    from megatron_grpo.models.tiny import build_hf_model

    d = tmp_path_factory.mktemp("packing") / "tiny"
    build_hf_model(d, "tiny", seed=3)
    return str(d)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_packed_equals_padded_and_gradient_ignores_packing(hf_dir, tp, pp):
    for r in run_distributed(_packing_worker, tp * pp, tp, pp, hf_dir, timeout=280):
        ref_logp, ref_ent = r["logp"]["padded"]
        assert ref_logp.abs().max() > 0.1
        for name in PACKINGS:
            logp, ent = r["logp"][name]
            assert (logp - ref_logp).abs().max() <= LOGP_TOL, name
            assert (ent - ref_ent).abs().max() <= LOGP_TOL, name
            assert r["loss"][name] == pytest.approx(r["loss"]["padded"], abs=1e-6), name
        ref_g, ref_w = r["grads"]["padded"], r["weights"]["padded"]
        scale = max(g.abs().max().item() for g in ref_g.values())
        assert scale > 1e-3
        for name in PACKINGS:
            g_err = max((r["grads"][name][n] - g).abs().max().item() for n, g in ref_g.items())
            w_err = max((r["weights"][name][n] - w).abs().max().item() for n, w in ref_w.items())
            assert g_err <= 1e-6 * scale, (name, g_err, scale)
            assert w_err <= 1e-7, (name, w_err)
            assert r["moved"][name] > 1e-3, (name, r["moved"])  # the step did move the weights
