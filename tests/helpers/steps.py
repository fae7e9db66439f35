"""Batches and losses for one policy train step: the parity batch and its loss
(``make_batch``, ``pg_loss``, ``hf_reference``: transformers' log-probs), the DP batch and
REINFORCE loss, and the GPU-configuration batch, loss and policy (``gpu_batch``,
``adv_loss``, ``build_policy_at``), the GPU suite's (``suite_batch``, ``suite_loss``,
``preset_policy``), and ``refusal``: the text of the error a step raises."""

from __future__ import annotations

from functools import partial

import torch

from megatron_grpo.algorithms.step_batch import AdvantagedBatch, Rows
from megatron_grpo.config.schema import ModelConfig, OptimConfig
from tests.helpers.batches import advantaged

MICRO_BATCH = 2


def make_batch(vocab_size: int) -> AdvantagedBatch:
    """4 right-padded sequences of different lengths; 2 micro-batches of different max len."""
    g = torch.Generator().manual_seed(0)
    lengths = [12, 7, 9, 5]
    ids = torch.zeros(4, 12, dtype=torch.long)
    attn = torch.zeros(4, 12)
    loss_mask = torch.zeros(4, 12)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(3, vocab_size, (n,), generator=g)
        attn[b, :n] = 1
        loss_mask[b, 3:n] = 1  # the first 3 tokens are the "prompt"
    return advantaged(ids, attention_mask=attn, loss_mask=loss_mask)


def pg_loss(logp, entropy, mb, *, n_tokens: float):
    """-mean over all response tokens of logp, plus a small entropy bonus (global normalizer)."""
    mask = mb.loss_mask
    loss = -(logp * mask).sum() / n_tokens - 0.01 * (entropy * mask).sum() / n_tokens
    return loss, {"response_logp": (logp * mask).sum() / mask.sum().clamp(min=1)}


def hf_reference(hf_dir: str, batch: Rows) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = batch.input_ids
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=batch.attention_mask.long()).logits
    logp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(ids.shape[0], 1), logp], 1) * batch.attention_mask


def dp_batch(vocab: int) -> AdvantagedBatch:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, vocab, (4, 8), generator=g)
    attn = torch.ones(4, 8)
    attn[1, 5:] = 0
    attn[3, 6:] = 0
    mask = attn.clone()
    mask[:, :2] = 0
    adv = torch.tensor([1.0, -0.5, 0.25, 2.0])
    return advantaged(ids, attention_mask=attn, loss_mask=mask, advantages=adv)


def reinforce_loss(logp, entropy, mb, *, n_tokens: float):
    """-sum(A * logp * mask) / global tokens: a micro-batch's share of the global objective."""
    mask = mb.loss_mask
    loss = -(mb.advantages[:, None] * logp * mask).sum() / n_tokens
    return loss, {"tokens": mask.sum()}


def gpu_batch(vocab: int, seed: int, rows: int = 4, length: int = 16) -> AdvantagedBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    attn = torch.ones(rows, length)
    attn[1, length - 5 :] = 0
    mask = attn.clone()
    mask[:, :4] = 0
    adv = torch.linspace(-1.0, 1.0, rows)
    return advantaged(ids, attention_mask=attn, loss_mask=mask, advantages=adv)


def adv_loss(logp, entropy, mb):
    return -(mb.advantages[:, None] * logp * mb.loss_mask).sum() / 100.0, {}


def build_policy_at(hf_dir, ctx, dtype: str, dist_opt: str, recompute: str = "none",
                    fused_adam: str = "auto"):  # fmt: skip

    from megatron_grpo.layouts.io import load_hf_into_megatron
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.policy import build_policy

    spec = load_spec(hf_dir)
    init = partial(load_hf_into_megatron, hf_dir=hf_dir, spec=spec, ctx=ctx)
    optim = OptimConfig(
        lr=1e-3, clip_grad=1.0, distributed_optimizer=dist_opt, fused_adam=fused_adam
    )
    model = ModelConfig(dtype=dtype, recompute=recompute)
    return build_policy(spec, ctx, model, optim, init_weights=init)


def train_steps(policy, ctx, first: int, last: int) -> list[float]:
    """Train steps ``first..last-1``, each DP rank on its own batch; the losses."""
    out = []
    for k in range(first, last):
        batch = gpu_batch(policy.vocab_size, seed=100 * k + ctx.dp_rank)
        out.append(policy.train_step(batch, adv_loss, micro_batch_size=2)["loss"])
    return out


def shard_copies(policy) -> dict[str, torch.Tensor]:
    """A detached copy of each of the policy's shards, by name."""
    return {n: p.detach().clone() for n, p in policy.named_shards()}


def suite_batch(vocab: int, rows: int = 8, length: int = 64, seed: int = 5) -> AdvantagedBatch:
    """The GPU suite's batch (tests/gpu): one row half padded, a prompt quarter unmasked."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    attn = torch.ones(rows, length)
    attn[1, length // 2 :] = 0
    mask = attn.clone()
    mask[:, : length // 4] = 0
    adv = torch.linspace(-1, 1, rows)
    return advantaged(ids, attention_mask=attn, loss_mask=mask, advantages=adv)


def suite_loss(logp, entropy, mb):
    mask = mb.loss_mask
    return -(mb.advantages[:, None] * logp * mask).sum() / 1000.0, {}


def preset_policy(ctx, preset, dtype, impl="local", **optim):
    """(spec, a fresh ``Policy``) of ``models/tiny.py`` preset ``preset``: ``dtype``, layer
    ``impl``, Adam with lr 1e-3 and clip 1.0 unless ``optim`` says otherwise."""
    from megatron_grpo.models.shapes import preset_spec
    from megatron_grpo.policy import build_policy

    spec = preset_spec(preset)
    opt = OptimConfig(**{"lr": 1e-3, "clip_grad": 1.0, **optim})
    return spec, build_policy(spec, ctx, ModelConfig(dtype=dtype, transformer_impl=impl), opt)


def refusal(error: type[Exception], fn, *args, **kwargs) -> str | None:
    """``str`` of the ``error`` that ``fn(*args, **kwargs)`` raises, None when it returns
    (for rank workers, whose results travel back as plain data)."""
    try:
        fn(*args, **kwargs)
    except error as e:
        return str(e)
    return None
