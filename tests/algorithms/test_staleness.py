"""grpo.off_policy.score_alpha (issue 33): the ratio pi_k/alpha_vLLM split into staleness and numerics.

Hand-derived numbers in the style of tests/algorithms/test_algorithms.py: a ratio r is built as
``logp = ln r`` against 0. The end-to-end runs are in tests/e2e/test_staleness_runs.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_grpo.algorithms import aggregation as agg
from megatron_grpo.algorithms import staleness as S
from megatron_grpo.algorithms.policy_loss import Role, RoleLogprobs, build_policy_loss
from megatron_grpo.bench.throughput.report import _score_alpha_lines
from megatron_grpo.bench.throughput.run import analyze_run
from megatron_grpo.config.schema import ConfigError
from megatron_grpo.metrics.summary import format_summary, summarize
from tests.helpers.batches import advantaged, loss_batch
from tests.helpers.configs import grpo_config
from tests.helpers.numerics import close, t

ln = math.log


def loss_of(cfg, logp, adv, mask, **roles):
    """``build_policy_loss(cfg)`` with the log-probs ``roles`` (RoleLogprobs' fields)."""
    return build_policy_loss(cfg)(logp, adv=adv, mask_BT=mask, lp=RoleLogprobs(**roles))


def test_the_two_parts_add_up_to_todays_log_ratio():
    pi, alpha, roll = t([[-1.0, -2.0]]), t([[-1.5, -2.0]]), t([[-1.25, -2.5]])
    numerics, staleness = S.split_log_ratios(pi, alpha, roll)
    close(numerics, [[-0.25, 0.5]])
    close(staleness, [[0.5, 0.0]])
    close(numerics + staleness, pi - roll)


def test_decomposition_metrics_golden():
    # Two sequences; the second's last token is padding (mask 0, values that must not count).
    # numerics = alpha - roll = [[ln 3, 0], [0, x]]; staleness = pi - alpha = [[0, ln .5], [ln 2, x]]
    # token means over 3 tokens: numerics ln3/3, staleness (ln .5 + ln 2)/3 = 0;
    # max |.|: ln 3 and ln 2. k3(d) = e^d - 1 - d: numerics k3(ln 3) = 2 - ln 3 -> /3;
    # staleness k3(ln .5) + k3(ln 2) = (-.5 + ln 2) + (1 - ln 2) = .5 -> /3.
    # TIS token, cap 2.5: numerics ratio [3, 1 | 1] touches 1 token, 1 of 2 sequences; the
    # mixed ratio pi/roll = [3, .5 | 2] touches the same token.
    roll = t([[0.0, 0.0], [0.0, 0.0]])
    alpha = t([[ln(3.0), 0.0], [0.0, 9.0]])
    pi = t([[ln(3.0), ln(0.5)], [ln(2.0), -9.0]])
    mask = t([[1.0, 1.0], [1.0, 0.0]])
    sums, maxima = S.decomposition_sums(pi, alpha, roll, mask, tis=(True, 2.5))
    m = S.decomposition_metrics(sums, maxima, with_tis=True)
    assert m["numerics_mean"] == pytest.approx(ln(3.0) / 3)
    assert m["staleness_mean"] == pytest.approx(0.0, abs=1e-7)
    assert m["numerics_max_abs"] == pytest.approx(ln(3.0))
    assert m["staleness_max_abs"] == pytest.approx(ln(2.0))
    assert m["numerics_kl"] == pytest.approx((2 - ln(3.0)) / 3)
    assert m["staleness_kl"] == pytest.approx(0.5 / 3)
    assert m["tis_tokens_frac"] == pytest.approx(1 / 3)
    assert m["tis_seqs_frac"] == pytest.approx(1 / 2)
    assert m["tis_mixed_tokens_frac"] == pytest.approx(1 / 3)
    # The sequence rule on the mixed ratio: seq 1 = 3 * .5 = 1.5, seq 2 = 2: none above 2.5.
    sums, maxima = S.decomposition_sums(pi, alpha, roll, mask, tis=(False, 2.5))
    m = S.decomposition_metrics(sums, maxima, with_tis=True)
    assert m["tis_seqs_frac"] == pytest.approx(1 / 2) and m["tis_mixed_seqs_frac"] == 0.0
    assert m["tis_tokens_frac"] == pytest.approx(2 / 3)  # every token of the touched sequence
    # Sums from two shards add up to the whole batch's (data parallel all-reduces them).
    a = S.decomposition_sums(pi[:1], alpha[:1], roll[:1], mask[:1], tis=(True, 2.5))
    b = S.decomposition_sums(pi[1:], alpha[1:], roll[1:], mask[1:], tis=(True, 2.5))
    whole = S.decomposition_sums(pi, alpha, roll, mask, tis=(True, 2.5))
    torch.testing.assert_close(a[0] + b[0], whole[0])
    torch.testing.assert_close(torch.maximum(a[1], b[1]), whole[1])


def test_same_weights_give_exactly_zero_staleness():
    logp = torch.randn(3, 5, dtype=torch.float32)
    sums, maxima = S.decomposition_sums(logp, logp.clone(), logp - 0.01, torch.ones(3, 5))
    m = S.decomposition_metrics(sums, maxima, with_tis=False)
    assert m["staleness_max_abs"] == 0.0 and m["staleness_kl"] == 0.0
    assert m["staleness_mean"] == 0.0 and "tis_tokens_frac" not in m


CONFIGS = [
    {"ratio_mode": "one"},
    {"ratio_mode": "exact"},
    {"ratio_mode": "exact", "dual_clip_c": 3.0},
    {"policy_loss": "rec", "rec_weight": "is"},
    {"policy_loss": "rec", "ratio_mode": "exact", "regularizer": "opmd", "regularizer_coef": 0.3},
    {"policy_loss": "gspo", "loss_agg": "seq_mean_token_mean", "clip_eps_low": 3e-4,
     "clip_eps_high": 4e-4},
]  # fmt: skip


@pytest.mark.parametrize("kw", CONFIGS)
def test_split_loss_with_alpha_trainer_in_alphas_place_is_todays_loss(kw):
    """Without TIS the split loss is today's loss with alpha_trainer where alpha_vLLM was:
    equal to it when the two engines agree, and blind to alpha_vLLM otherwise."""
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(4, 6, generator=g) - 0.5
    alpha, old = logp - 0.1 * torch.randn(4, 6, generator=g), logp - 0.05
    adv, mask = torch.randn(4, generator=g), (torch.rand(4, 6, generator=g) > 0.2).float()
    today, split = grpo_config(**kw), grpo_config(score_alpha=True, **kw)
    # alpha_trainer is read wherever alpha was: the clip's r, and pi_old under ratio_mode=one
    reads_alpha = kw.get("policy_loss") is None or kw.get("ratio_mode") != "exact"
    assert (Role.ALPHA_TRAINER in build_policy_loss(split).needs) == reads_alpha
    assert Role.ALPHA_TRAINER not in build_policy_loss(today).needs
    want, _ = loss_of(today, logp, adv, mask, alpha_engine=alpha, pi_k=old)
    got, _ = loss_of(split, logp, adv, mask, alpha_engine=alpha, alpha_trainer=alpha, pi_k=old)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    other_vllm = alpha + 0.3 * torch.randn(4, 6, generator=g)
    got2, _ = loss_of(split, logp, adv, mask, alpha_engine=other_vllm, alpha_trainer=alpha,
                      pi_k=old)  # fmt: skip
    torch.testing.assert_close(got2, want, rtol=0, atol=0)


def test_tis_truncates_the_numerics_ratio_only():
    # pi = pi_k = -1 (r = 1, A = 1 -> surrogate -1). alpha_trainer = -1 - ln 3 (staleness 3,
    # the off-policy clip's concern), alpha_vLLM = alpha_trainer - ln 1.5 (numerics 1.5 < cap 2).
    # Today (exact + TIS): w = min(pi_k/alpha_vLLM = 4.5, 2) = 2 -> loss -2, capped.
    # Split: w = numerics ratio 1.5, not capped; off_policy_clip exact: r = pi/alpha = 3,
    # r' = pi_k/alpha = 3, band [2.8, 3.2] -> f = 3 -> loss -3 * 1.5 = -4.5 (the full
    # importance weight pi/alpha_vLLM = 4.5, staleness kept unclipped by the r' centre).
    cfg = {"ratio_mode": "exact", "tis": "token_truncate", "tis_cap": 2.0}
    logp, old, adv, mask = t([[-1.0]]), t([[-1.0]]), t([1.0]), t([[1.0]])
    alpha = t([[-1.0 - ln(3.0)]])
    roll = alpha - ln(1.5)
    loss, m = loss_of(grpo_config(**cfg), logp, adv, mask, alpha_engine=roll, pi_k=old)
    close(loss, [[-2.0]])
    close(m["tis_frac_capped"], 1.0)
    split = grpo_config(score_alpha=True, **cfg)
    loss, m = loss_of(split, logp, adv, mask, alpha_engine=roll, alpha_trainer=alpha, pi_k=old)
    close(loss, [[-4.5]])
    close(m["tis_frac_capped"], 0.0)
    close(m["tis_weight_mean"], 1.5)


def test_split_tis_needs_no_exact_ratio_and_the_loss_fn_reads_alpha_trainer():
    with pytest.raises(ConfigError, match="grpo.off_policy.score_alpha=true"):
        grpo_config(tis="token_mask")
    cfg = grpo_config(score_alpha=True, tis="token_mask", tis_cap=2.0)  # ratio_mode=one
    fn = agg.make_loss_fn(cfg)
    # One token: pi = alpha_trainer (r = 1), A = 1 -> -1; numerics 3 > 2 -> masked -> loss 0.
    assert fn.needs == {Role.ALPHA_TRAINER, Role.ALPHA_ENGINE}  # pi_k not scored for it
    roles = {"loss_mask": t([[1.0]]), "advantages": t([1.0]),
             "alpha_engine_logp": t([[-1.0 - ln(3.0)]])}  # fmt: skip
    with pytest.raises(ValueError, match="alpha_trainer's log-probs"):
        fn(t([[-1.0]]), t([[0.0]]), loss_batch(**roles))
    loss, m = fn(t([[-1.0]]), t([[0.0]]), loss_batch(**roles, alpha_trainer_logp=t([[-1.0]])))
    close(loss, 0.0)
    close(m["tis_frac_capped"], 1.0)
    mb = loss_batch(**roles, alpha_trainer_logp=t([[-1.0 - ln(1.5)]]))
    loss, _ = fn(t([[-1.0]]), t([[0.0]]), mb)
    # r = pi/alpha_trainer = 1.5, clipped to 1.2 (eps .2, A > 0) -> -1.2; numerics ratio
    # alpha_trainer/alpha_vLLM = 3/1.5 = 2 <= cap: kept as the weight -> -2.4.
    close(loss, -2.4)


def test_summary_reports_both_parts():
    rows = [
        {"step": 1, "reward_mean": 0.5, "time_step": 1.0, "lag": 0, "staleness_kl": 0.0,
         "numerics_kl": 1e-9, "staleness_max_abs": 0.0, "numerics_max_abs": 2e-5,
         "tis_tokens_frac": 0.0, "tis_seqs_frac": 0.0, "tis_mixed_tokens_frac": 0.0,
         "tis_mixed_seqs_frac": 0.0},
        {"step": 2, "reward_mean": 0.5, "time_step": 1.0, "lag": 1, "staleness_kl": 0.2,
         "numerics_kl": 3e-9, "staleness_max_abs": 1.5, "numerics_max_abs": 1e-5,
         "tis_tokens_frac": 0.0, "tis_seqs_frac": 0.0, "tis_mixed_tokens_frac": 0.1,
         "tis_mixed_seqs_frac": 0.5},
    ]  # fmt: skip
    s = summarize(rows, 2)
    assert s["staleness_kl_mean"] == pytest.approx(0.1) and s["staleness_kl_max"] == 0.2
    assert s["numerics_max_abs"] == 2e-5 and s["tis_mixed_seqs_frac_mean"] == 0.25
    text = format_summary(s)
    assert "staleness KL mean 0.1 (max 0.2), numerics KL mean 2e-09" in text
    assert (
        "TIS touched 0.00% of tokens, 0.00% of sequences (on the mixed ratio 5.00%, 25.00%)" in text
    )
    assert "staleness" not in format_summary(summarize([dict(rows[0], staleness_kl=None)], 2))


def test_bench_throughput_reports_alphas_pass():
    # Steps 2..4 measured (warm-up 1): alpha's pass 0 at lag 0 (step 3: no key, not timed),
    # 0.1 and 0.2 s later in the window -> 0.1 s per step of the 1 s steps.
    rows = [{"step": 1, "time_step": 1.0, "time_score_alpha": 0.5},
            {"step": 2, "time_step": 1.0, "time_score_alpha": 0.1},
            {"step": 3, "time_step": 1.0},
            {"step": 4, "time_step": 1.0, "time_score_alpha": 0.2}]  # fmt: skip
    r = analyze_run(rows, 2, warmup=1)
    assert r["score_alpha_mean_s"] == pytest.approx(0.1)
    assert _score_alpha_lines([r]) == [
        "v=2: grpo.off_policy.score_alpha's log-prob pass 0.100 s per step (10.0% of a step; in train)"
    ]
    assert analyze_run([{k: v for k, v in x.items() if k != "time_score_alpha"} for x in rows],
                       2, warmup=1)["score_alpha_mean_s"] is None  # fmt: skip


def _copy_scores_worker(rank, world_size, hf_dir):
    from megatron_grpo.config.schema import ModelConfig, OptimConfig, ParallelConfig
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.policy import build_policy

    spec = load_spec(hf_dir)
    with distributed_context(ParallelConfig(), spec, seed=3) as ctx:
        policy = build_policy(spec, ctx, ModelConfig(), OptimConfig(lr=1e-2), temperature=0.7)
        g = torch.Generator().manual_seed(5)
        ids = torch.randint(3, spec.vocab_size, (4, 9), generator=g)
        attn = torch.ones(4, 9)
        attn[1, 6:] = 0
        batch = advantaged(ids, attention_mask=attn, loss_mask=attn.clone(),
                           advantages=torch.tensor([1.0, -1.0, 0.5, 2.0]))  # fmt: skip

        def loss_fn(logp, entropy, mb):
            return -(mb.advantages[:, None] * logp * mb.loss_mask).sum(), {}

        policy.train_step(batch, loss_fn, micro_batch_size=2)  # weights moved from the load
        alpha = policy.make_reference()  # what the trainer keeps of the served weights
        out = {}
        for budget in (None, 20):  # padded rows, and packed micro-batches
            a = policy.compute_logprobs(batch, 2, token_budget=budget)["logp"]
            b = alpha.compute_logprobs(batch, 2, token_budget=budget)["logp"]
            out[budget] = (torch.equal(a, b), float((a - b).abs().max()))
        policy.train_step(batch, loss_fn, micro_batch_size=2)
        moved = policy.compute_logprobs(batch, 2)["logp"] - alpha.compute_logprobs(batch, 2)["logp"]
        out["moved"] = float(moved.abs().max())
        return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_kept_copy_scores_bitwise_like_the_policy(tiny_dir):
    """Later in a window alpha is scored by the kept copy (``Policy.make_reference``): at the
    policy's own weights it must give the policy's log-probs bit for bit, or the staleness
    part would carry a numerics of its own."""
    from tests.dist_utils import run_distributed

    (r,) = run_distributed(_copy_scores_worker, 1, tiny_dir, timeout=220)
    assert r[None] == (True, 0.0) and r[20] == (True, 0.0), r
    assert r["moved"] > 1e-4, r  # a step later the copy is alpha, no longer pi_k


def test_bench_reproduce_claim_6_compares_adaptive_by_staleness():
    from megatron_grpo.bench.reproduce.claims import plan_runs

    runs, run_of = plan_runs([5, 6])
    by = {r.name: r for r in runs}
    staleness = by[run_of[(6, "adaptive, staleness")]]
    assert "grpo.off_policy.score_alpha=true" in staleness.overrides
    assert "sync.mode=adaptive" in staleness.overrides
    assert run_of[(6, "adaptive, mixed")] == run_of[(5, "adaptive")]  # run once for both
    assert by[run_of[(6, "fixed, same syncs")]].match == staleness.name


def test_tensorboard_files_the_parts_under_their_own_tag():
    from megatron_grpo.metrics.logger import _tb_tag

    assert _tb_tag("staleness_kl") == "ratio_parts/staleness_kl"
    assert _tb_tag("numerics_max_abs") == "ratio_parts/numerics_max_abs"
    assert _tb_tag("tis_mixed_seqs_frac") == "ratio_parts/tis_mixed_seqs_frac"
    assert _tb_tag("tis_weight_mean") == "train/tis_weight_mean"  # the loss's own metric
    assert _tb_tag("time_score_alpha") == "time/score_alpha"
