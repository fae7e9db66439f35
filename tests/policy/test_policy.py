"""Policy: vocab-parallel log-prob/entropy (golden vs full-vocab log_softmax, exact
gradients), LR schedule, micro-batching, and the train step's gradient contract at DP=2."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from megatron_grpo.algorithms.step_batch import AdvantagedBatch
from megatron_grpo.config.schema import ConfigError, OptimConfig
from megatron_grpo.policy.logprob import token_logprobs, vocab_parallel_logprob_entropy
from megatron_grpo.policy.lr_schedule import LRSchedule
from megatron_grpo.policy.micro_batches import micro_batches
from tests.dist_utils import run_distributed
from tests.helpers.batches import advantaged
from tests.helpers.steps import dp_batch, refusal, reinforce_loss

VOCAB, PADDED = 10, 16  # 6 padding columns, like megatron's padded vocabulary


def reference(logits: torch.Tensor, target: torch.Tensor):
    ls = torch.log_softmax(logits[..., :VOCAB], -1)
    logp = ls.gather(-1, target[..., None])[..., 0]
    entropy = -(ls.exp() * ls).sum(-1)
    return logp, entropy


def test_full_vocab_matches_log_softmax_and_ignores_padding():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, PADDED, generator=g, dtype=torch.float64)
    logits[..., VOCAB:] = 50.0  # padding columns must not enter the softmax
    target = torch.randint(0, VOCAB, (3, 5), generator=g)
    logp, ent = vocab_parallel_logprob_entropy(logits, target, vocab_start=0, vocab_size=VOCAB)
    ref_logp, ref_ent = reference(logits, target)
    assert torch.allclose(logp, ref_logp, atol=1e-12)
    assert torch.allclose(ent, ref_ent, atol=1e-12)


def test_gradients_are_exact():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, PADDED, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, VOCAB, (4,), generator=g)
    w = torch.randn(4, generator=g, dtype=torch.float64)

    def f(x):
        logp, ent = vocab_parallel_logprob_entropy(x, target, vocab_start=0, vocab_size=VOCAB)
        return (w * logp).sum() + (w.flip(0) * ent).sum()

    def ref(x):
        logp, ent = reference(x, target)
        return (w * logp).sum() + (w.flip(0) * ent).sum()

    (grad,) = torch.autograd.grad(f(logits), logits)
    (ref_grad,) = torch.autograd.grad(ref(logits), logits)
    assert torch.allclose(grad, ref_grad, atol=1e-12)
    assert torch.autograd.gradcheck(f, (logits,))


def test_token_logprobs_are_position_aligned():
    logits = torch.randn(2, 4, VOCAB, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (2, 4))
    logp, ent = token_logprobs(logits, ids, vocab_start=0, vocab_size=VOCAB)
    assert logp.shape == ids.shape and torch.all(logp[:, 0] == 0) and torch.all(ent[:, 0] == 0)
    ref_logp, _ = reference(logits[:, 2], ids[:, 3])
    assert torch.allclose(logp[:, 3], ref_logp)


def _tp_worker(rank, world_size, logits, target, w):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        shard = PADDED // world_size
        local = logits[:, rank * shard : (rank + 1) * shard].clone().requires_grad_(True)
        logp, ent = vocab_parallel_logprob_entropy(
            local, target, vocab_start=rank * shard, vocab_size=VOCAB, group=dist.group.WORLD
        )
        ((w * logp).sum() + (w * ent).sum()).backward()
        return logp.detach(), ent.detach(), local.grad
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tp2_matches_full_vocab_without_gathering():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, PADDED, generator=g)
    target = torch.tensor([0, 3, 7, 8, 9, 5])  # targets in both shards
    w = torch.randn(6, generator=g)
    res = run_distributed(_tp_worker, 2, logits, target, w, timeout=100)
    x = logits.clone().requires_grad_(True)
    ref_logp, ref_ent = reference(x, target)
    ((w * ref_logp).sum() + (w * ref_ent).sum()).backward()
    for rank, (logp, ent, grad) in enumerate(res):
        assert torch.allclose(logp, ref_logp, atol=1e-6)
        assert torch.allclose(ent, ref_ent, atol=1e-6)
        assert torch.allclose(grad, x.grad[:, rank * 8 : (rank + 1) * 8], atol=1e-6)


def test_lr_schedule_warmup_then_cosine():
    s = LRSchedule(OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=2, lr_schedule="cosine"), 6)
    got = [s.lr_at(k) for k in range(7)]
    cos = [0.1 + 0.45 * (1 + math.cos(math.pi * p)) for p in (0, 0.25, 0.5, 0.75, 1.0)]
    assert got == pytest.approx([0.5, 1.0, *cos])
    c = LRSchedule(OptimConfig(lr=2.0, warmup_steps=0), 10)
    assert [c.lr_at(k) for k in (0, 5, 50)] == [2.0, 2.0, 2.0]


def test_lr_schedule_owns_its_step_and_state():
    """The schedule advances itself, sets the optimizer's rate, and a resumed one continues
    where it was saved; a cosine schedule of another length is refused, naming both."""
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=2, lr_schedule="cosine")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=99.0)
    s = LRSchedule(cfg, 6, opt)
    assert opt.param_groups[0]["lr"] == s.current_lr == 0.5
    for _ in range(3):
        s.step()
    assert s.state_dict() == {"step_count": 3, "total_steps": 6}
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=99.0)
    resumed = LRSchedule(cfg, 6, opt2)
    resumed.load_state_dict(s.state_dict())
    assert resumed.state_dict() == s.state_dict()
    assert opt2.param_groups[0]["lr"] == s.current_lr == s.lr_at(3)
    with pytest.raises(
        ConfigError, match=r"total_steps=6 optimizer steps but this run's config gives 8"
    ):
        LRSchedule(cfg, 8).load_state_dict(s.state_dict())
    # A constant schedule's length enters no rate: a longer run resumes under it.
    longer = LRSchedule(OptimConfig(lr=2.0), 8)
    longer.load_state_dict({"step_count": 3, "total_steps": 6})
    assert longer.state_dict() == {"step_count": 3, "total_steps": 8} and longer.current_lr == 2.0


def test_micro_batches_trim_to_their_own_longest_sequence():
    ids = torch.arange(24).view(4, 6)
    attn = torch.tensor([[1] * 6, [1] * 2 + [0] * 4, [1] * 3 + [0] * 3, [1] * 2 + [0] * 4])
    batch = advantaged(
        ids, attention_mask=attn, loss_mask=attn.float(), advantages=torch.arange(4.0)
    )
    mbs = micro_batches(batch, micro_batch_size=2)
    assert [(rows, length) for rows, length, _ in mbs] == [(slice(0, 2), 6), (slice(2, 4), 3)]
    assert mbs[1][2].input_ids.shape == (2, 3) and mbs[1][2].advantages.tolist() == [2.0, 3.0]
    assert type(mbs[1][2]) is AdvantagedBatch and mbs[1][2].loss_mask.shape == (2, 3)
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\), input_ids has B=4"):
        advantaged(ids, loss_mask=attn.float(), advantages=torch.zeros(3))


# ------------------------------------------------------------------ train step at DP=2


def nan_loss(logp, entropy, mb):
    return (logp * float("nan")).sum(), {}


def _dp_worker(rank, world_size, hf_dir):
    from megatron_grpo.config.schema import ModelConfig, ParallelConfig
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.policy import build_policy

    spec = load_spec(hf_dir)
    with distributed_context(ParallelConfig(), spec, seed=3) as ctx:
        assert ctx.dp == 2 and ctx.dp_rank == rank
        policy = build_policy(spec, ctx, ModelConfig(), OptimConfig(lr=1e-3, clip_grad=0.0))
        full = dp_batch(spec.vocab_size)
        n_tokens = float(full.loss_mask.sum())
        rows = slice(2 * rank, 2 * rank + 2)  # each DP rank gets its own half
        mine = full.select(rows)
        before = {n: p.detach().clone() for n, p in policy.named_shards()}
        loss_fn = partial(reinforce_loss, n_tokens=n_tokens)
        metrics = policy.train_step(mine, loss_fn, micro_batch_size=1)
        main_grads = {n: p.main_grad.clone() for n, p in policy.models[0].named_parameters()}
        out = {"metrics": metrics, "names": [n for n, _ in policy.named_shards()]}
        if rank == 0:
            # Reference: plain autograd of the summed global loss over the FULL batch, with
            # the pre-step weights, outside megatron's schedule, DDP and optimizer.
            ref = build_policy(spec, ctx, ModelConfig(), None)
            for n, p in ref.named_shards():
                p.copy_(before[n])
            params = [p.requires_grad_(True) for _, p in ref.named_shards()]
            model = ref.models[0]
            pos = torch.arange(8).expand(4, 8)
            hidden = model(full.input_ids, pos, None, **ref.scoring.forward_kwargs)
            logp, ent = ref.scoring.token_logprobs(hidden, full.input_ids, ref.temperature)
            loss, _ = loss_fn(logp, ent, full)
            grads = torch.autograd.grad(loss, params)
            names = [n for n, _ in ref.named_shards()]
            out["grad_err"] = max(
                (main_grads[n] - g).abs().max().item() for n, g in zip(names, grads)
            )
            out["grad_scale"] = max(g.abs().max().item() for g in grads)
            out["ref_loss"] = loss.item()
        # forward-only log-probs: a reference copy agrees with the policy, and padding is 0
        lp = policy.compute_logprobs(mine, micro_batch_size=2)
        ref_copy = policy.make_reference()
        lp_ref = ref_copy.compute_logprobs(mine, micro_batch_size=1)
        out["ref_copy_err"] = (lp["logp"] - lp_ref["logp"]).abs().max().item()
        out["pad_zero"] = bool((lp["logp"][mine.attention_mask == 0] == 0).all())
        # a NaN loss skips the step: weights and lr unchanged
        after = {n: p.detach().clone() for n, p in policy.named_shards()}
        nan_metrics = policy.train_step(mine, nan_loss, micro_batch_size=2)
        out["nan_metrics"] = nan_metrics
        out["unchanged"] = all(torch.equal(after[n], p) for n, p in policy.named_shards())
        sd = policy.sharded_state_dict()
        out["state_keys"] = sorted(sd)
        # NaN steps 2 and 3 in a row are skipped too; the 4th exceeds
        # optim.max_nan_steps_in_row (3) and aborts with a message that says what to do.
        for _ in range(2):
            policy.train_step(mine, nan_loss, micro_batch_size=2)
        out["abort"] = refusal(RuntimeError, policy.train_step, mine, nan_loss, micro_batch_size=2)
        return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_train_step_gradient_is_grad_of_summed_global_loss(tiny_dir):
    res = run_distributed(_dp_worker, 2, tiny_dir, timeout=220)
    r0, r1 = res
    # DP=2, 2 micro-batches per rank: no 1/num_microbatches, no 1/dp on the gradient
    assert r0["grad_err"] < 1e-6 * max(1.0, r0["grad_scale"]), r0
    assert r0["grad_scale"] > 1e-3
    for r in res:
        assert r["metrics"]["loss"] == pytest.approx(r0["ref_loss"], abs=1e-6)
        assert r["metrics"]["skipped"] is False and r["metrics"]["lr"] == 1e-3
        assert r["metrics"]["tokens"] == pytest.approx(r0["metrics"]["tokens"])
        assert r["ref_copy_err"] < 1e-6 and r["pad_zero"]
        assert r["nan_metrics"]["skipped"] is True and r["unchanged"]
        assert r["state_keys"] == ["lr_schedule", "model", "optimizer"]
        assert r["abort"] is not None, "4 non-finite steps in a row must abort"
        assert "4 optimizer steps in a row" in r["abort"]
        assert "optim.max_nan_steps_in_row=3" in r["abort"]
    assert "decoder.layers.1.mlp.linear_fc2.weight" in r0["names"]
    assert "embedding.word_embeddings.weight" in r0["names"]
    assert not any(n.startswith("chunk") for n in r0["names"])
