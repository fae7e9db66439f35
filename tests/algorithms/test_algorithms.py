"""Golden tests of the algorithm library: every number below is worked out by hand.

Conventions: ``ln`` is the natural log; a ratio ``r`` is built as ``logp = ln r``,
``behav = 0`` so that ``exp(logp - behav) = r`` exactly up to float rounding.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_grpo.algorithms import advantages as adv_mod
from megatron_grpo.algorithms import aggregation as agg
from megatron_grpo.algorithms import kl as kl_mod
from megatron_grpo.algorithms import losses as L
from megatron_grpo.algorithms.policy_loss import RoleLogprobs, build_policy_loss
from megatron_grpo.algorithms.shaping import overlong_filter_keep, overlong_penalty
from tests.helpers.batches import advantaged, loss_batch
from tests.helpers.configs import grpo_config
from tests.helpers.numerics import close, t

ln = math.log


def policy_loss(cfg, logp, adv, mask, alpha_engine, pi_k=None):
    """``build_policy_loss(cfg)`` on one set of inputs, the log-probs by role."""
    lp = RoleLogprobs(alpha_engine=alpha_engine, pi_k=pi_k)
    return build_policy_loss(cfg)(logp, adv=adv, mask_BT=mask, lp=lp)


# ------------------------------------------------------------------------------ advantages
def test_grpo_whitening_population_std():
    # r = [1, 0, 0, 1]: mean 0.5, deviations +-0.5, population var 0.25.
    # With eps = 0.75 the denominator is sqrt(0.25 + 0.75) = 1, so A = deviations.
    close(adv_mod.group_whiten(t([[1, 0, 0, 1]]), eps=0.75), [[0.5, -0.5, -0.5, 0.5]])
    # r = [0, 0, 0, 3]: mean 0.75, dev [-.75, -.75, -.75, 2.25],
    # var = (3 * 0.5625 + 5.0625) / 4 = 1.6875; eps = 0.5625 -> sqrt(2.25) = 1.5
    # A = dev / 1.5 = [-0.5, -0.5, -0.5, 1.5].
    close(adv_mod.group_whiten(t([[0, 0, 0, 3]]), eps=0.5625), [[-0.5, -0.5, -0.5, 1.5]])
    # eps = 0: r = [1, 0] -> mean .5, std .5 -> [1, -1] (population, not sample, std).
    close(adv_mod.group_whiten(t([[1, 0]]), eps=0.0), [[1.0, -1.0]])


def test_drgrpo_center_only():
    # Dr.GRPO: A = r - mean = [0,0,0,3] - 0.75.
    close(adv_mod.group_center(t([[0, 0, 0, 3]])), [[-0.75, -0.75, -0.75, 2.25]])


def test_red_weight_scales_each_centered_advantage_by_exp_of_it_over_tau():
    # centered [0, 2] -> [-1, 1]; A * exp(A / 1) = [-1/e, e] = [-0.367879, 2.718282]
    # with tau = 2: [-exp(-0.5), exp(0.5)] = [-0.606531, 1.648721].
    centered = adv_mod.group_center(t([[0, 2]]))
    close(adv_mod.red_weight(centered, tau=1.0), [[-0.367879, 2.718282]])
    close(adv_mod.red_weight(centered, tau=2.0), [[-0.606531, 1.648721]])


def test_zero_variance_mask_exact():
    # [0.1]*3 has a float std that need not be exactly 0; max != min is exact.
    mask = adv_mod.zero_variance_mask(t([[2, 2, 2], [1, 2, 3], [0.1, 0.1, 0.1]]))
    assert mask.tolist() == [False, True, False]


def test_red_drop_ties_count_as_positive():
    # r = [0, 0, 0, 3, 2, 1]: mean 1 -> negatives {0, 0, 0}, strict positives {3, 2}, one tie
    # {1}. Ties count as positive (the REC paper's released code, Trinity-RFT): 3 vs 3, no
    # drop. The old rule (positive = r > mean) saw 3 vs 2 and dropped a zero.
    keep = adv_mod.red_drop_keep(t([[0, 0, 0, 3, 2, 1]]), torch.Generator().manual_seed(0))
    assert keep.tolist() == [[True] * 6]
    # and with a real surplus it still drops: [0, 0, 0, 3] -> 3 neg vs 1 pos -> drop 2.
    keep = adv_mod.red_drop_keep(t([[0, 0, 0, 3]]), torch.Generator().manual_seed(0))
    assert keep.sum().item() == 2 and keep[0, 3].item()


def test_red_drop_golden():
    # r = [1, 0, 0, 0]: mean .25, 3 negatives vs 1 positive -> drop 2 of the 3 zeros.
    # Kept {1, 0}: mean .5, var .25; eps = .75 -> A = [.5, -.5], dropped get 0.
    cfg = grpo_config(group_size=4, red_drop=True, advantage_eps=0.75)
    out = adv_mod.build_advantage_fn(cfg)(t([[1, 0, 0, 0]]), torch.Generator().manual_seed(0))
    keep = out.keep[0].tolist()
    assert keep[0] is True and sum(keep[1:]) == 1
    kept_neg = 1 + keep[1:].index(True)
    expected = [0.5, 0.0, 0.0, 0.0]
    expected[kept_neg] = -0.5
    close(out.advantages, [expected])
    assert out.metrics["frac_dropped"] == pytest.approx(0.5)
    # The same seed drops the same samples.
    again = adv_mod.build_advantage_fn(cfg)(t([[1, 0, 0, 0]]), torch.Generator().manual_seed(0))
    assert again.keep.equal(out.keep)


def test_advantage_fn_masks_zero_variance_groups():
    # group 0 all equal -> masked (keep False, A exactly 0); group 1 = [1, 0] eps 0 -> [1, -1].
    cfg = grpo_config(group_size=2, advantage_eps=0.0)
    out = adv_mod.build_advantage_fn(cfg)(t([[0.1, 0.1], [1, 0]]))
    assert out.keep.tolist() == [[False, False], [True, True]]
    assert out.advantages[0].tolist() == [0.0, 0.0]
    close(out.advantages[1], [1.0, -1.0])
    assert out.metrics["frac_zero_variance_groups"] == 0.5


def test_advantage_setting_selects_drgrpo_centering_or_red_weight():
    r = t([[0, 2]])
    dr = adv_mod.build_advantage_fn(grpo_config(group_size=2, advantage="drgrpo"))(r)
    close(dr.advantages, [[-1.0, 1.0]])
    rw = adv_mod.build_advantage_fn(grpo_config(group_size=2, advantage="red_weight"))(r)
    close(rw.advantages, [[-0.367879, 2.718282]])


# -------------------------------------------------------------------- off-policy clipping
def _ratio_case():
    # seq 0 (A = +1) has ratios [1.5, 0.5]; seq 1 (A = -1) has ratios [0.5, 1.5].
    logp = t([[ln(1.5), ln(0.5)], [ln(0.5), ln(1.5)]]).requires_grad_()
    behav = torch.zeros(2, 2)
    return logp, behav, t([1.0, -1.0]), torch.ones(2, 2)


def test_off_policy_clip_ppo_limit():
    # eps = .2, r' = 1 -> bounds [0.8, 1.2].
    # (A=+1, r=1.5): min(1.5, 1.2) = 1.2 -> loss -1.2, clipped (grad 0)
    # (A=+1, r=0.5): min(0.5, 0.8) = 0.5 -> loss -0.5, grad -A*r = -0.5
    # (A=-1, r=0.5): min(-0.5, -0.8) = -0.8 -> loss 0.8, clipped (grad 0)
    # (A=-1, r=1.5): min(-1.5, -1.2) = -1.5 -> loss 1.5, grad -A*r = +1.5
    logp, behav, a, mask = _ratio_case()
    loss, m = L.off_policy_clip_loss(logp, behav, a, mask, 0.2, 0.2)
    close(loss, [[-1.2, -0.5], [0.8, 1.5]])
    loss.sum().backward()
    close(logp.grad, [[0.0, -0.5], [0.0, 1.5]])
    close(m["clip_frac_high"], 0.25)
    close(m["clip_frac_low"], 0.25)
    close(m["ratio_mean"], 1.0)
    close(m["ratio_min"], 0.5)
    close(m["ratio_max"], 1.5)


def test_off_policy_clip_exact_r_prime():
    # r' = pi_k / alpha. Token (A=+1, r=1.5, r'=1.4): bounds [1.2, 1.6] -> min(1.5, 1.5),
    # loss -1.5, not clipped. Token (A=-1, r=0.05, r'=0.1): low = max(0.1 - 0.2, 0) = 0,
    # clip(0.05, 0, 0.3) = 0.05 -> loss +0.05, not clipped (the max(., 0) keeps it valid).
    logp = t([[ln(1.5)], [ln(0.05)]])
    prox = t([[ln(1.4)], [ln(0.1)]])
    loss, m = L.off_policy_clip_loss(
        logp, torch.zeros(2, 1), t([1.0, -1.0]), torch.ones(2, 1), 0.2, 0.2, pi_k_logp_BT=prox
    )
    close(loss, [[-1.5], [0.05]])
    close(m["clip_frac_high"], 0.0)
    close(m["clip_frac_low"], 0.0)


def test_off_policy_clip_dapo_asymmetric_and_dual_clip():
    # DAPO eps_high = .28: (A=+1, r=1.5) -> min(1.5, 1.28) = 1.28.
    loss, _ = L.off_policy_clip_loss(t([[ln(1.5)]]), t([[0.0]]), t([1.0]), t([[1.0]]), 0.2, 0.28)
    close(loss, [[-1.28]])
    # Dual clip c = 3: (A=-1, r=4): min(-4, -1.2) = -4, max(-4, 3 * -1) = -3 -> loss 3, no grad.
    # (A=-1, r=2): min(-2, -1.2) = -2 > -3 -> unchanged, loss 2.
    logp = t([[ln(4.0)], [ln(2.0)]]).requires_grad_()
    loss, m = L.off_policy_clip_loss(
        logp, torch.zeros(2, 1), t([-1.0, -1.0]), torch.ones(2, 1), 0.2, 0.2, dual_clip_c=3.0
    )
    close(loss, [[3.0], [2.0]])
    loss.sum().backward()
    close(logp.grad, [[0.0], [2.0]])
    close(m["dual_clip_frac"], 0.5)


# ------------------------------------------------------------------------------------ REC
def test_rec_masks_table():
    # rho = [0.3, 0.7, 1.0, 1.5, 3.5], eps = (.2, .2), ring eps' = (.6, 2.0):
    # A=+1 one-side rho<=1.2: [1,1,1,0,0]; two-side .8<=rho<=1.2: [0,0,1,0,0];
    #      ring: two-side or rho<=0.4: [1,0,1,0,0]
    # A=-1 one-side rho>=0.8: [0,0,1,1,1]; two-side [0,0,1,0,0]; ring: or rho>=3: [0,0,1,0,1]
    rho = t([0.3, 0.7, 1.0, 1.5, 3.5])
    pos, neg = torch.ones(5), -torch.ones(5)
    assert L.rec_mask_one_side(rho, pos, 0.2, 0.2).tolist() == [1, 1, 1, 0, 0]
    assert L.rec_mask_one_side(rho, neg, 0.2, 0.2).tolist() == [0, 0, 1, 1, 1]
    assert L.rec_mask_two_side(rho, pos, 0.2, 0.2).tolist() == [0, 0, 1, 0, 0]
    assert L.rec_mask_two_side(rho, neg, 0.2, 0.2).tolist() == [0, 0, 1, 0, 0]
    assert L.rec_mask_ring(rho, pos, 0.2, 0.2, 0.6, 2.0).tolist() == [1, 0, 1, 0, 0]
    assert L.rec_mask_ring(rho, neg, 0.2, 0.2, 0.6, 2.0).tolist() == [0, 0, 1, 0, 1]
    assert L.rec_mask_none(rho, pos).tolist() == [1] * 5
    close(L.rec_weight_is(rho), rho)


def test_rec_tis_is_the_papers_clamp():
    # REC paper / Trinity-RFT: w = clamp(rho, 1 - eps'_low, 1 + eps'_high); with
    # eps' = (.6, 2.0) the band is [.4, 3]: rho [.3, .7, 1, 1.5, 3.5] -> [.4, .7, 1, 1.5, 3].
    # (The old min(rho, cap) left .3 at .3: the lower clamp is what makes it the paper's.)
    rho = t([0.3, 0.7, 1.0, 1.5, 3.5])
    close(L.rec_weight_tis(rho, 0.6, 2.0), [0.4, 0.7, 1.0, 1.5, 3.0])
    # Built from the config: rec_weight=tis reads rec_ring_eps_low/high (eps'), A = 1, mask none
    # -> loss = -w * logp; logp = ln .3, old = 0 -> rho = .3 -> w = .4 -> loss = -.4 ln .3.
    cfg = grpo_config(policy_loss="rec", rec_clip="none", rec_weight="tis")
    loss, _ = policy_loss(cfg, t([[ln(0.3)]]), t([1.0]), t([[1.0]]), t([[0.0]]))
    close(loss, [[-0.4 * ln(0.3)]])


def test_rec_loss_golden():
    # A = 2, logp = ln[.5, .5, .25], old = ln[.5, .25, .5] -> rho = [1, 2, .5].
    # one-side (eps .2): A>0 keeps rho <= 1.2 -> M = [1, 0, 1].
    # NoIS: loss = -A * logp * M = [-2 ln .5, 0, -2 ln .25] = [1.386294, 0, 2.772589];
    #       grad = -A * M = [-2, 0, -2].
    # IS:   w = rho -> [1.386294, 0, 0.5 * 2.772589 = 1.386294]; grad = [-2, 0, -1].
    old = t([[ln(0.5), ln(0.25), ln(0.5)]])
    one_side = lambda rho, a: L.rec_mask_one_side(rho, a, 0.2, 0.2)  # noqa: E731
    for weight_fn, exp_loss, exp_grad in (
        (L.rec_weight_none, [1.386294, 0.0, 2.772589], [-2.0, 0.0, -2.0]),
        (L.rec_weight_is, [1.386294, 0.0, 1.386294], [-2.0, 0.0, -1.0]),
    ):
        logp = t([[ln(0.5), ln(0.5), ln(0.25)]]).requires_grad_()
        loss, m = L.rec_loss(logp, old, t([2.0]), torch.ones(1, 3), one_side, weight_fn)
        close(loss, [exp_loss])
        loss.sum().backward()
        close(logp.grad, [exp_grad])
        close(m["rec_masked_frac"], 1 / 3)


# ----------------------------------------------------------------------------------- GSPO
def test_gspo_golden():
    # log rho per token = [0.1, 0.3] -> mean 0.2 -> s = e^0.2 = 1.221403 for both tokens.
    # A = +1, eps (3e-4, 4e-4): s > 1.0004 -> clipped: loss = -1.0004 per token, grad 0.
    # A = -1: min(-1.221403, -1.0004) = -1.221403 -> loss 1.221403; d loss/d logp_t = s.
    old = torch.zeros(2, 2)
    logp = t([[0.1, 0.3], [0.1, 0.3]]).requires_grad_()
    loss, m = L.gspo_loss(logp, old, t([1.0, -1.0]), torch.ones(2, 2), 3e-4, 4e-4)
    close(loss, [[-1.0004, -1.0004], [1.221403, 1.221403]])
    # seq_mean_token_mean over the 2 seqs: d/dlogp = s / |y| / N_seqs = 1.221403 / 2 / 2.
    agg.agg_seq_mean_token_mean(loss, torch.ones(2, 2), 2.0).backward()
    close(logp.grad, [[0.0, 0.0], [0.305351, 0.305351]])
    close(m["clip_frac_high"], 0.5)
    close(m["ratio_mean"], 1.221403)


# ------------------------------------------------------------------------------------ TIS
def test_tis_weights_golden():
    # old - rollout per token = ln[3, 0.5]; C = 2.
    # token truncate: [min(3,2), .5] = [2, .5]; token mask: [0, .5]
    # seq ratio = 3 * .5 = 1.5 (<= 2): truncate and mask both [1.5, 1.5].
    # seq ratio with tokens ln[3, 1] = 3 > 2: truncate [2, 2], mask [0, 0].
    old, roll, mask = t([[ln(3.0), ln(0.5)]]), torch.zeros(1, 2), torch.ones(1, 2)
    tok, seq = L.token_is_ratio(old, roll, mask), L.seq_is_ratio(old, roll, mask)
    close(L.truncate_weight(tok, 2.0), [[2.0, 0.5]])
    close(L.mask_weight(tok, 2.0), [[0.0, 0.5]])
    close(L.truncate_weight(seq, 2.0), [[1.5, 1.5]])
    close(L.mask_weight(seq, 2.0), [[1.5, 1.5]])
    seq3 = L.seq_is_ratio(t([[ln(3.0), 0.0]]), roll, mask)
    close(L.truncate_weight(seq3, 2.0), [[2.0, 2.0]])
    close(L.mask_weight(seq3, 2.0), [[0.0, 0.0]])
    # Masked-out positions do not enter the sequence ratio: mask [1, 0] -> ratio 3 -> 2.
    close(L.truncate_weight(L.seq_is_ratio(old, roll, t([[1.0, 0.0]])), 2.0), [[2.0, 2.0]])


def test_tis_in_policy_loss():
    # exact + token_truncate: loss = min(pi_k/alpha, 2) * PPO(pi/pi_k).
    # pi = pi_k (r = 1, unclipped), A = 1 -> PPO loss -1; pi_k/alpha = 3 -> w = 2 -> loss -2.
    cfg = grpo_config(ratio_mode="exact", tis="token_truncate", tis_cap=2.0)
    logp = t([[-1.0]])
    loss, m = policy_loss(cfg, logp, t([1.0]), t([[1.0]]), t([[-1.0 - ln(3.0)]]), t([[-1.0]]))
    close(loss, [[-2.0]])
    close(m["tis_frac_capped"], 1.0)


# --------------------------------------------------------------------------- regularizers
def test_regularizers_and_entropy():
    # AsymRE c = .1, logp = -2 -> -c * logp = 0.2; OPMD c = .5, (-1 - -1.5)^2 * .5 = 0.125.
    close(L.asymre_term(t([-2.0]), 0.1), [0.2])
    close(L.opmd_term(t([-1.0]), t([-1.5]), 0.5), [0.125])
    close(L.entropy_bonus(t([2.0]), 0.01), [-0.02])
    # Through the builder: rec NoIS no clip, A = 0 -> only the regularizer remains.
    cfg = grpo_config(policy_loss="rec", rec_clip="none", regularizer="opmd", regularizer_coef=0.5)
    loss, _ = policy_loss(cfg, t([[-1.0]]), t([0.0]), t([[1.0]]), t([[-1.5]]))
    close(loss, [[0.125]])


# ------------------------------------------------------------------------------------- KL
def test_kl_estimators_golden():
    # logp = -1, ref = -1.5: d = ref - logp = -0.5 -> k1 = 0.5, k2 = 0.125,
    #   k3 = e^-0.5 + 0.5 - 1 = 0.106531
    # logp = -2, ref = -1: d = 1 -> k1 = -1, k2 = 0.5, k3 = e - 1 - 1 = 0.718282
    logp, ref = t([-1.0, -2.0]), t([-1.5, -1.0])
    close(kl_mod.kl_k1(logp, ref), [0.5, -1.0])
    close(kl_mod.kl_k2(logp, ref), [0.125, 0.5])
    close(kl_mod.kl_k3(logp, ref), [0.106531, 0.718282])
    # KL in the reward: 1 - 0.1 * (0.106531 + 0.718282) = 0.917519.
    out = kl_mod.kl_penalized_rewards(
        t([1.0]), t([[-1.0, -2.0]]), t([[-1.5, -1.0]]), torch.ones(1, 2), 0.1, kl_mod.kl_k3
    )
    close(out, [0.917519])
    with pytest.raises(ValueError, match="k4"):
        kl_mod.get_kl_estimator("k4")


# ----------------------------------------------------------------------------- aggregation
def test_aggregation_modes_golden():
    # loss [[1, 2, 3], [4, x, x]], mask [[1, 1, 1], [1, 0, 0]]; 4 tokens, 2 sequences.
    # token_mean: 10 / 4 = 2.5; seq_mean_token_mean: (6/3 + 4/1) / 2 = 3;
    # seq_mean_token_sum: 10 / 2 = 5; constant C = 5: 10 / (2 * 5) = 1.
    loss = t([[1, 2, 3], [4, 99, 99]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    close(agg.agg_token_mean(loss, mask, 4.0), 2.5)
    close(agg.agg_seq_mean_token_mean(loss, mask, 2.0), 3.0)
    close(agg.agg_seq_mean_token_sum(loss, mask, 2.0), 5.0)
    close(agg.agg_constant(loss, mask, 2.0, 5.0), 1.0)
    # Normalizers: a fully masked row is not a sequence; micro-batches with different T sum.
    norms = agg.compute_global_normalizers([mask, t([[0, 0], [1, 1]])])
    close(norms.num_tokens, 6.0)
    close(norms.num_seqs, 3.0)


def test_loss_fn_golden():
    # Defaults (off_policy_clip, r' = 1, token_mean) + k3 KL beta .1 + entropy .01.
    # logp = rollout -> r = 1, A = 1 -> policy loss -1 per token.
    # ref = [-1.5, -2], logp = [-1, -1] -> d = [-.5, -1] -> k3 = [0.106531, 0.367879]
    # entropy [2, 1]: token losses -1 + .0106531 - .02 = -1.0093469,
    #                              -1 + .0367879 - .01 = -0.9732121
    # token_mean over 2 global tokens: -1.9825590 / 2 = -0.9912795.
    cfg = grpo_config(kl_coef=0.1, entropy_coef=0.01)
    loss_fn = agg.make_loss_fn(cfg)
    mb = loss_batch(
        loss_mask=t([[1, 1]]),
        advantages=t([1.0]),
        alpha_engine_logp=t([[-1.0, -1.0]]),
        pi_ref_logp=t([[-1.5, -2.0]]),
    )
    loss, m = loss_fn(t([[-1.0, -1.0]]), t([[2.0, 1.0]]), mb)
    close(loss, -0.9912795)
    close(m["kl_ref"], (0.106531 + 0.367879) / 2)
    close(m["entropy"], 1.5)


def test_loss_fn_errors_name_the_fix():
    loss_fn = agg.make_loss_fn(grpo_config(ratio_mode="exact"))
    mb = loss_batch(loss_mask=t([[1.0]]), advantages=t([1.0]), alpha_engine_logp=t([[0.0]]))
    with pytest.raises(ValueError, match=r"pi_k's log-probs.*Role.PI_K"):
        loss_fn(t([[0.0]]), t([[0.0]]), mb)
    with pytest.raises(ValueError, match="max_response_len"):
        agg.make_loss_fn(grpo_config(loss_agg="constant"))
    # constant mode takes rollout.max_new_tokens when loss_agg_constant is 0.
    fn = agg.make_loss_fn(grpo_config(loss_agg="constant"), max_response_len=4)
    mb2 = loss_batch(
        loss_mask=t([[1.0, 1.0]]), advantages=t([1.0]), alpha_engine_logp=t([[0.0, 0.0]])
    )
    close(fn(t([[0.0, 0.0]]), torch.zeros(1, 2), mb2)[0], -2.0 / 4)


# ------------------------------------------------------------------------------- shaping
def test_overlong_shaping_golden():
    # L_max 10, buffer 4 -> free up to 6; L=8 -> -(8-6)/4 = -0.5; L=10 -> -1; penalty 2 doubles.
    close(overlong_penalty(t([5, 6, 8, 10]), 10, 4, 1.0), [0.0, 0.0, -0.5, -1.0])
    close(overlong_penalty(t([8]), 10, 4, 2.0), [-1.0])
    assert overlong_filter_keep(torch.tensor([True, False])).tolist() == [False, True]
    with pytest.raises(ValueError, match="overlong_buffer"):
        overlong_penalty(t([1]), 10, 11, 1.0)


# ----------------------------------------------------------------------- issue-12 behaviour
def test_zero_variance_mask_uses_task_rewards_with_kl_in_reward():
    # Task rewards [1, 1] (no signal) penalised by KL to [0.9, 0.7]: the group must stay
    # masked; the old code masked on the penalised rewards and whitened pure KL to +-1.
    fn = adv_mod.build_advantage_fn(grpo_config(group_size=2, advantage_eps=0.0))
    task = t([[1.0, 1.0], [1.0, 0.0]])
    penalised = task - t([[0.1, 0.3], [0.1, 0.3]])
    out = fn(penalised, None, task)
    assert out.keep.tolist() == [[False, False], [True, True]]
    assert out.advantages[0].tolist() == [0.0, 0.0]
    # group 1 is whitened on the penalised rewards [.9, -.3]: +-1.
    close(out.advantages[1], [1.0, -1.0])


def test_log_ratio_clamped_before_exp():
    # A = -1, dual-clip off, log-ratio 25: unclamped the loss would be e^25 = 7.2e10; clamped
    # at 20 it is e^20 = 4.85e8, and the token passes no gradient (outside the band).
    logp = t([[25.0]]).requires_grad_()
    loss, _ = L.off_policy_clip_loss(logp, torch.zeros(1, 1), t([-1.0]), torch.ones(1, 1), 0.2, 0.2)
    close(loss, [[math.exp(20.0)]], tol=1e-4)
    loss.sum().backward()
    assert logp.grad.item() == 0.0
    # exact mode r', REC rho, GSPO s, TIS ratios and k3 are clamped the same way.
    big, zero, one = t([[50.0]]), torch.zeros(1, 1), torch.ones(1, 1)
    rho = L.rec_loss(big, zero, t([1.0]), one, L.rec_mask_none, L.rec_weight_is)[1]["ratio_max"]
    close(rho, math.exp(20.0), tol=1e-4)
    close(L.gspo_loss(big, zero, t([1.0]), one, 0.2, 0.2)[1]["ratio_max"], math.exp(20.0), 1e-4)
    close(L.token_is_ratio(big, zero, one), [[math.exp(20.0)]], tol=1e-4)
    close(L.seq_is_ratio(big, zero, one), [[math.exp(20.0)]], tol=1e-4)
    close(kl_mod.kl_k3(zero, big), [[math.exp(20.0) - 21.0]], tol=1e-4)
    r_prime = L.off_policy_clip_loss(zero, zero, t([1.0]), one, 0.2, 0.2, pi_k_logp_BT=big)
    assert torch.isfinite(r_prime[0]).all()


def test_gspo_needs_sequence_mean_aggregation():
    with pytest.raises(ValueError, match="loss_agg=seq_mean_token_mean"):
        grpo_config(policy_loss="gspo", loss_agg="token_mean")
    grpo_config(policy_loss="gspo", loss_agg="seq_mean_token_mean")


def test_loss_normalizer_kept_vs_all_and_constant_is_constant():
    # Mini-batch of 4 responses x 2 tokens; the advantage step kept only rows 0 and 1.
    # per-token loss 1 on kept tokens -> sum 4.
    resp = torch.ones(4, 2)
    keep = t([[1, 1], [1, 1], [0, 0], [0, 0]])
    mb = advantaged(loss_mask=keep, response_mask=resp)
    kept = agg.compute_global_normalizers(agg.normalizer_mask(mb, "kept"))
    every = agg.compute_global_normalizers(agg.normalizer_mask(mb, "all"))
    loss = torch.ones(4, 2)
    # kept: 4 / 4 tokens = 1 (DAPO renormalises); all: 4 / 8 = .5 (paper's E over all prompts)
    close(agg.agg_token_mean(loss, keep, kept.num_tokens), 1.0)
    close(agg.agg_token_mean(loss, keep, every.num_tokens), 0.5)
    close(agg.agg_seq_mean_token_mean(loss, keep, every.num_seqs), 0.5)
    # constant: divided by the mini-batch's 4 rows x C = 2 whatever the masks: 4 / 8 = .5,
    # with the kept or the all counts alike (the old code divided by the 2 kept sequences).
    fn = agg.make_loss_fn(grpo_config(loss_agg="constant", loss_agg_constant=2.0))
    for norms in (kept, every):
        full = loss_batch(loss_mask=keep, response_mask=resp, advantages=t([-1.0] * 4),
                          alpha_engine_logp=torch.zeros(4, 2), normalizers=norms)  # fmt: skip
        close(fn(torch.zeros(4, 2), torch.zeros(4, 2), full)[0], 0.5)


def test_overlong_shaping_on_rewards():
    from megatron_grpo.algorithms.shaping import shape_rewards

    # L_max 10, buffer 4: lengths [5, 8, 10, 10] -> penalties [0, -.5, -1, -1] added.
    r = t([[1, 1], [0, 1]])
    close(shape_rewards(r, t([5, 8, 10, 10]), 10, 4, 1.0), [[1.0, 0.5], [-1.0, 0.0]])
    assert shape_rewards(r, t([5, 8, 10, 10]), 10, 0, 1.0) is r
