"""Property tests (hypothesis) of the algorithm library's invariants."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_grpo.algorithms import advantages as adv_mod
from megatron_grpo.algorithms import aggregation as agg
from megatron_grpo.algorithms import losses as L
from megatron_grpo.algorithms.step_batch import Normalizers
from megatron_grpo.config.schema import GRPOConfig
from tests.helpers.batches import loss_batch
from tests.helpers.configs import grpo_config


def property_test(**strategies):
    """A hypothesis test over ``strategies`` and a ``seed`` for the tensors it draws, run on
    60 examples without a deadline."""
    return lambda fn: settings(max_examples=60, deadline=None)(
        given(seed=st.integers(0, 10_000), **strategies)(fn)
    )


def _rand(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


@property_test(
    b=st.integers(1, 6),
    tt=st.integers(1, 7),
    eps_low=st.floats(0.0, 0.9),
    eps_high=st.floats(0.0, 3.0),
)
def test_r_prime_one_is_ppo_clipping(seed, b, tt, eps_low, eps_high):
    """With r' = 1 (no proximal log-probs, or pi_k == alpha) f_eps is PPO's clipped objective."""
    logp = _rand(seed, b, tt, scale=0.5)
    behav = _rand(seed + 1, b, tt, scale=0.5)
    adv = _rand(seed + 2, b)
    mask = torch.ones(b, tt, dtype=torch.float64)
    r = torch.exp(logp - behav)
    a = adv[:, None]
    ppo = -torch.minimum(r * a, torch.clamp(r, 1 - eps_low, 1 + eps_high) * a)
    if eps_low > 1:  # pragma: no cover - excluded by the strategy; max(1 - eps, 0) is 1 - eps
        return
    one, _ = L.off_policy_clip_loss(logp, behav, adv, mask, eps_low, eps_high)
    exact, _ = L.off_policy_clip_loss(logp, behav, adv, mask, eps_low, eps_high, pi_k_logp_BT=behav)
    torch.testing.assert_close(one, ppo, rtol=0, atol=0)
    torch.testing.assert_close(exact, ppo, rtol=0, atol=0)


@property_test(
    p=st.integers(1, 5),
    g=st.integers(2, 6),
    n_const=st.integers(1, 5),
    policy_loss=st.sampled_from(["off_policy_clip", "rec", "gspo"]),
    advantage=st.sampled_from(["grpo", "drgrpo", "red_weight"]),
    loss_agg=st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]),
)
def test_zero_variance_groups_get_exactly_zero_gradient(
    seed, p, g, n_const, policy_loss, advantage, loss_agg
):
    """A prompt whose G rewards are equal contributes exactly nothing, KL and entropy included."""
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (p + n_const, g), generator=gen).float()
    rewards[p:] = rewards[p:, :1]  # the last n_const groups are constant
    if policy_loss == "gspo":  # GSPO is tied to sequence-mean aggregation (config check)
        loss_agg = "seq_mean_token_mean"
    cfg = grpo_config(
        group_size=g,
        policy_loss=policy_loss,
        advantage=advantage,
        loss_agg=loss_agg,
        kl_coef=0.1,
        entropy_coef=0.01,
    )
    out = adv_mod.build_advantage_fn(cfg)(rewards)
    n, tt = rewards.numel(), 5
    logp = (_rand(seed, n, tt, scale=0.3) - 1).float().requires_grad_()
    entropy = torch.rand(n, tt, generator=gen).requires_grad_()
    mask = (torch.rand(n, tt, generator=gen) > 0.2).float()
    mask = mask * out.keep.reshape(-1, 1)
    mb = loss_batch(
        loss_mask=mask,
        advantages=out.advantages.reshape(-1),
        alpha_engine_logp=(logp.detach() + 0.1 * _rand(seed + 3, n, tt).float()) * mask,
        pi_ref_logp=logp.detach() - 0.2,
    )
    loss, _ = agg.make_loss_fn(cfg)(logp, entropy, mb)
    loss.backward()
    const_rows = slice(p * g, None)
    assert torch.count_nonzero(logp.grad[const_rows]) == 0
    assert torch.count_nonzero(entropy.grad[const_rows]) == 0
    assert torch.isfinite(logp.grad).all()


@property_test(p=st.integers(1, 8), g=st.integers(2, 9), levels=st.integers(2, 5))
def test_red_drop_keeps_positives_and_balances(seed, p, g, levels):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, levels, (p, g), generator=gen).float()
    keep = adv_mod.red_drop_keep(rewards, torch.Generator().manual_seed(seed + 1))
    mean = rewards.mean(dim=1, keepdim=True)
    neg = rewards < mean
    pos = ~neg  # ties with the mean count as positive (REC's released code)
    assert keep[pos].all()  # positives untouched
    n_pos, n_neg = pos.sum(1), neg.sum(1)
    kept_neg = (neg & keep).sum(1)
    expected = torch.where(n_neg > n_pos, n_pos, n_neg)
    assert kept_neg.tolist() == expected.tolist()  # surplus negatives dropped, no others


def _split(n: int, cuts: list[int]) -> list[tuple[int, int]]:
    points = sorted({0, n, *[c % (n + 1) for c in cuts]})
    return [(a, b) for a, b in zip(points[:-1], points[1:]) if b > a]


POLICY_VARIANTS = [
    {},
    {"ratio_mode": "exact", "dual_clip_c": 3.0, "clip_eps_high": 0.28},
    {"ratio_mode": "exact", "tis": "seq_mask", "tis_cap": 1.5},
    {"policy_loss": "rec", "rec_clip": "ring", "rec_weight": "tis"},
    {"policy_loss": "gspo", "clip_eps_low": 3e-4, "clip_eps_high": 4e-4},
    {"policy_loss": "rec", "regularizer": "asymre", "regularizer_coef": 0.1},
]


@property_test(
    b=st.integers(1, 12),
    tt=st.integers(1, 6),
    dp_cuts=st.lists(st.integers(0, 12), max_size=3),
    mb_cuts=st.lists(st.integers(0, 12), max_size=4),
    loss_agg=st.sampled_from(
        ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant"]
    ),
    variant=st.sampled_from(POLICY_VARIANTS),
)
def test_aggregation_invariant_to_micro_batch_and_dp_split(
    seed, b, tt, dp_cuts, mb_cuts, loss_agg, variant
):
    """Sum over DP ranks and micro-batches of per-micro-batch losses == the full-batch loss.

    The normalizers are computed over the union of all ranks' micro-batches (what the DP
    all-reduce in compute_global_normalizers does), then each piece is evaluated alone.
    """
    if variant.get("policy_loss") == "gspo":  # GSPO is tied to sequence-mean aggregation
        loss_agg = "seq_mean_token_mean"
    cfg = grpo_config(
        loss_agg=loss_agg,
        loss_agg_constant=7.0,
        kl_coef=0.05,
        entropy_coef=0.01,
        **variant,
    )
    loss_fn = agg.make_loss_fn(cfg)
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, tt, generator=gen, dtype=torch.float64) * 2
    mask = (torch.rand(b, tt, generator=gen) > 0.3).double()
    roles = {
        "advantages": torch.randn(b, generator=gen, dtype=torch.float64),
        "alpha_engine_logp": logp + 0.2 * torch.randn(b, tt, generator=gen, dtype=torch.float64),
        "pi_k_logp": logp + 0.1 * torch.randn(b, tt, generator=gen, dtype=torch.float64),
        "pi_ref_logp": logp - 0.3,
    }
    entropy = torch.rand(b, tt, generator=gen, dtype=torch.float64)
    ranks = _split(b, dp_cuts)
    pieces = [[(lo + a, lo + c) for a, c in _split(hi - lo, mb_cuts)] for lo, hi in ranks]
    # Each rank counts its micro-batches; the DP all-reduce sums the counts.
    counts = sum(agg.local_loss_counts([mask[a:c] for a, c in mbs]) for mbs in pieces)
    norms = _double(agg.normalizers_from_counts(counts))
    ref_norms = _double(agg.compute_global_normalizers(mask))
    torch.testing.assert_close(norms.parts(), ref_norms.parts())
    full = loss_batch(loss_mask=mask, normalizers=norms, **roles)

    def run(a: int, c: int) -> torch.Tensor:
        return loss_fn(logp[a:c], entropy[a:c], full.select(slice(a, c)))[0]

    whole = run(0, b)
    summed = sum(run(a, c) for mbs in pieces for a, c in mbs)
    torch.testing.assert_close(summed, whole, rtol=1e-10, atol=1e-12)


def _double(n: Normalizers) -> Normalizers:
    return Normalizers(**{k: v.double() for k, v in n.parts().items()})


def test_local_normalizers_would_break_invariance():
    """The same check with per-micro-batch token counts fails: the global count matters."""
    cfg = GRPOConfig()
    loss_fn = agg.make_loss_fn(cfg)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    roles = {"advantages": torch.tensor([1.0, 1.0]), "alpha_engine_logp": torch.zeros(2, 3)}
    logp = torch.zeros(2, 3)
    whole = loss_fn(logp, logp, loss_batch(loss_mask=mask, **roles))[0]
    local = sum(
        loss_fn(
            logp[i : i + 1],
            logp[i : i + 1],
            loss_batch(loss_mask=mask[i : i + 1], **{k: v[i : i + 1] for k, v in roles.items()}),
        )[0]
        for i in range(2)
    )
    assert whole.item() == pytest.approx(-1.0) and local.item() == pytest.approx(-2.0)
