"""Packed micro-batches with expert parallelism (``policy/forward.py``, ``policy/micro_batches.py``
``agreed_count``, ``empty_micro_batch``).

- The empty micro-batch a rank adds to reach the agreed count: the pack of a filler only
  (a multiple of tp tokens, every routed expert -1) or one row of them, scoring no token.
- EP=2 on two spawned gloo ranks (the tiny MoE, fp32): the ranks' batches pack into 1 and 3
  micro-batches under the token budget (2 each padded), so rank 0 runs 2 empty ones; the
  packed log-probs, entropies, loss and gradients equal the padded ones (<= 1e-5), with the
  router's own choice and with routing replay of given experts; and at PP=2 x EP=2 (4 ranks),
  where each stage's EP group agrees on the count the pipeline schedule runs.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from megatron_grpo.policy.micro_batches import PackedRows, empty_micro_batch
from tests.dist_utils import run_distributed
from tests.helpers.batches import advantaged, rows

TOL = 1e-5
BUDGET = 18
# rank 0: 15 real tokens, one pack under the budget; rank 1: 14 | 12 | 9 + 7, three packs;
# padded, two rows per micro-batch: 2 micro-batches on each rank
LENGTHS = {0: (5, 4, 6, 3), 1: (14, 12, 9, 7)}
WIDTH = 16


def test_an_empty_micro_batch_scores_no_token_and_routes_by_the_router():
    ids = torch.arange(1, 13).view(2, 6)
    routed = torch.zeros(2, 6, 3, 2, dtype=torch.int16)
    like = rows(ids, routed_experts=routed)
    mb, pack = empty_micro_batch(like, PackedRows.build(ids, [6, 6], routed=routed), multiple=4)
    assert mb.num_rows == 0 and pack is not None
    assert pack.input_ids.tolist() == [[0, 0, 0, 0]] and pack.cu_seqlens.tolist() == [0, 4]
    assert pack.rows.numel() == 0  # no token is scored
    assert pack.routed_experts is not None and pack.routed_experts.shape == (4, 3, 2)
    assert (pack.routed_experts == -1).all() and pack.routed_experts.dtype == torch.int16
    padded, none = empty_micro_batch(like, None, multiple=1)
    assert none is None and padded.input_ids.shape == (1, 2)
    assert padded.routed_experts is not None and (padded.routed_experts == -1).all()


def _rank_batch(vocab: int, layers: int, rank: int):
    """This rank's rows (lengths ``LENGTHS[rank]``), with given experts for every real token
    (two of four, -1 past each row) for routing replay."""
    g = torch.Generator().manual_seed(10 + rank)
    lengths = LENGTHS[rank]
    b = len(lengths)
    ids = torch.zeros(b, WIDTH, dtype=torch.long)
    attn, loss_mask = torch.zeros(b, WIDTH), torch.zeros(b, WIDTH)
    routed = torch.full((b, WIDTH, layers, 2), -1, dtype=torch.int16)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, vocab, (n,), generator=g)
        attn[i, :n] = 1
        loss_mask[i, 2:n] = 1
        for t in range(n):
            for layer in range(layers):
                routed[i, t, layer] = torch.randperm(4, generator=g)[:2].to(torch.int16)
    adv = torch.linspace(-1.0, 1.5, b) * (1 if rank == 0 else -0.7)
    return advantaged(ids, attention_mask=attn, loss_mask=loss_mask, advantages=adv,
                      routed_experts=routed)  # fmt: skip


def pg_loss(logp, entropy, mb, *, n_tokens: float):
    mask = mb.loss_mask
    loss = -(mb.advantages[:, None] * logp * mask).sum() / n_tokens
    loss = loss - 0.01 * (entropy * mask).sum() / n_tokens
    return loss, {"tokens": mask.sum()}


def _ep2_packing_worker(rank, world_size, hf_dir, pp=1):
    from megatron_grpo.config.schema import ModelConfig, OptimConfig, ParallelConfig
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.layouts import load_hf_into_megatron
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.policy import build_policy

    spec = load_spec(hf_dir)
    with distributed_context(ParallelConfig(ep=2, pp=pp), spec, seed=1) as ctx:
        batch = _rank_batch(spec.vocab_size, spec.num_layers, ctx.dp_rank)
        # the loss's normalizer: both ranks' tokens (sum of LENGTHS' response tokens)
        n_tokens = float(sum(n - 2 for lengths in LENGTHS.values() for n in lengths))
        loss_fn = partial(pg_loss, n_tokens=n_tokens)
        out = {}
        for replay in (False, True) if pp == 1 else (False,):  # replay: at pp=1 only
            for budget in (None, BUDGET):
                policy = build_policy(
                    spec, ctx, ModelConfig(),
                    OptimConfig(lr=1e-2, clip_grad=0.0, adam_eps=1e-1),
                    init_weights=lambda ch: load_hf_into_megatron(ch, hf_dir, spec, ctx),
                    routing_replay=replay,
                )  # fmt: skip
                counts = len(policy.forward.split(batch, 2, budget))
                lp = policy.compute_logprobs(batch, 2, token_budget=budget)
                metrics = policy.train_step(batch, loss_fn, 2, token_budget=budget)
                grads = {n: p.main_grad.clone() for n, p in policy.models[0].named_parameters()}
                out[replay, budget] = {
                    "count": counts, "logp": lp["logp"], "entropy": lp["entropy"],
                    "loss": metrics["loss"], "tokens": metrics["tokens"], "grads": grads,
                }  # fmt: skip
        return out


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    from megatron_grpo.models.tiny import build_hf_model

    return str(build_hf_model(tmp_path_factory.mktemp("moe_pack") / "m", "tiny-moe", seed=3))


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("pp", [1, 2])
def test_packed_ep2_equals_padded_with_different_micro_batch_counts(moe_dir, pp):
    """pp=2: 4 ranks, each stage's EP group agrees on the count, and so both stages run the
    pipeline schedule's same number of micro-batches."""
    torch.set_num_threads(1)
    ranks = run_distributed(_ep2_packing_worker, 2 * pp, moe_dir, pp, timeout=380)
    report = []
    # the ranks pack into different counts (DP rank 0 runs two empty micro-batches)
    dp_rank = [rank % 2 for rank in range(2 * pp)]  # rank order tp-cp-ep-dp-pp
    assert [r[False, BUDGET]["count"] for r in ranks] == [[1, 3][d] for d in dp_rank]
    assert [r[False, None]["count"] for r in ranks] == [2] * len(ranks)
    for rank, r in enumerate(ranks):
        for replay in (False, True) if pp == 1 else (False,):
            ref, packed = r[replay, None], r[replay, BUDGET]
            assert ref["logp"].abs().max() > 0.1
            d_logp = (packed["logp"] - ref["logp"]).abs().max().item()
            d_ent = (packed["entropy"] - ref["entropy"]).abs().max().item()
            scale = max(g.abs().max().item() for g in ref["grads"].values())
            d_g = max((packed["grads"][n] - g).abs().max().item() for n, g in ref["grads"].items())
            report.append(f"rank {rank} {replay=}: logp {d_logp:.1e} entropy {d_ent:.1e} "
                          f"grad {d_g:.1e} (max {scale:.1e})")  # fmt: skip
            assert d_logp <= TOL and d_ent <= TOL, report[-1]
            assert packed["loss"] == pytest.approx(ref["loss"], abs=TOL)
            # the metrics average each rank's real micro-batches (1 and 3), not the empty ones
            tokens = [sum(n - 2 for n in LENGTHS[k]) / count for k, count in ((0, 1), (1, 3))]
            assert packed["tokens"] == pytest.approx(sum(tokens) / 2)
            assert scale > 1e-3 and d_g <= TOL * scale, report[-1]
            # every local expert of this rank got a gradient
            experts = [g for n, g in ref["grads"].items() if ".experts." in n]
            assert experts and all(g.abs().max() > 0 for g in experts), rank
        # replaying other experts than the router's changes the forward
        assert pp > 1 or (r[True, None]["logp"] - r[False, None]["logp"]).abs().max() > 1e-3
    print("\n".join(report))
