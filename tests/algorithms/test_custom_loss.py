"""A user's loss in one module (docs/algorithms.md, "Write your own loss"): the worked example
docs/examples/cispo_loss.py loaded by ``grpo.loss.policy_loss``, its hand-derived numbers, and the
trainer scoring exactly the log-probs a loss declares (``needs``)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_grpo.algorithms.aggregation import make_loss_fn
from megatron_grpo.algorithms.policy_loss import Role
from megatron_grpo.config.schema import Config, ConfigError
from megatron_grpo.trainer.logprobs import StepLogprobs
from tests.helpers.batches import advantaged, loss_batch
from tests.helpers.configs import grpo_config
from tests.helpers.numerics import close, t

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "cispo_loss.py"
CISPO = f"{EXAMPLE}:Cispo"
ln = math.log


def test_the_worked_example_loads_and_gives_the_hand_derived_loss():
    # r = pi/alpha = 1.5 (logp = ln 1.5 against 0), eps_high .28 -> weight min(1.5, 1.28)
    # = 1.28; A = 1 -> loss -1.28 ln 1.5 per token, gradient -1.28 (the weight is detached).
    # Second token r = .5 -> weight .5, loss -.5 ln .5; token mean over the 2 tokens.
    fn = make_loss_fn(grpo_config(policy_loss=CISPO, clip_eps_high=0.28))
    assert fn.needs == {Role.ALPHA_ENGINE}
    logp = t([[ln(1.5), ln(0.5)]]).requires_grad_()
    mb = loss_batch(loss_mask=t([[1.0, 1.0]]), advantages=t([1.0]),
                    alpha_engine_logp=torch.zeros(1, 2))  # fmt: skip
    loss, m = fn(logp, torch.zeros(1, 2), mb)
    close(loss, (-1.28 * ln(1.5) - 0.5 * ln(0.5)) / 2)
    loss.backward()
    close(logp.grad, [[-1.28 / 2, -0.5 / 2]])
    close(m["cispo_clip_frac"], 0.5)
    # Composed like a built-in: a KL term adds pi_ref to what the trainer must score.
    exact = make_loss_fn(grpo_config(policy_loss=CISPO, ratio_mode="exact", kl_coef=0.1))
    assert exact.needs == {Role.PI_K, Role.PI_REF}


class _Counting:
    """A policy whose log-prob pass returns -1 everywhere and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def compute_logprobs(self, batch, micro_batch_size, token_budget=None):
        self.calls += 1
        return {"logp": -torch.ones(batch.input_ids.shape)}


@pytest.mark.parametrize(
    "grpo, passes, pi_k",
    [
        ({"policy_loss": CISPO}, 0, False),  # reads alpha as served: no trainer pass
        ({"policy_loss": CISPO, "ratio_mode": "exact"}, 1, True),  # reads pi_k: one pass
        ({"ratio_mode": "exact"}, 1, True),  # the built-in exact ratio, the same way
        ({}, 0, False),
    ],
)
def test_the_trainer_scores_what_the_loss_declares(grpo, passes, pi_k):
    cfg = Config(grpo=grpo_config(**grpo))
    policy = _Counting()
    ctx = SimpleNamespace(dp=1, dp_rank=0, world_size=1)
    needs = make_loss_fn(cfg.grpo).needs
    scoring = StepLogprobs(cfg, ctx, policy, None, None, None, None, needs)
    batch = advantaged(loss_mask=t([[0.0, 1.0, 1.0]]))
    scored = scoring.score(batch, None, lag=0, adaptive=False)
    assert policy.calls == passes
    assert (scored.batch.pi_k_logp is not None) == pi_k
    assert scored.batch.alpha_trainer_logp is None and scored.batch.pi_ref_logp is None
    assert (scored.drift is not None) == pi_k  # the drift is read off pi_k's pass


def test_a_bad_loss_is_one_line_that_names_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"or to a loss class 'path/to/file.py:Name'"):
        grpo_config(policy_loss="cispo")
    with pytest.raises(ValueError, match=r"loss file 'nowhere.py' .* does not exist"):
        make_loss_fn(grpo_config(policy_loss="nowhere.py:Loss"))
    with pytest.raises(ValueError, match="has no attribute 'Missing'"):
        make_loss_fn(grpo_config(policy_loss=f"{EXAMPLE}:Missing"))
    bad = tmp_path / "bad_loss.py"
    bad.write_text("class NoNeeds:\n    def __init__(self, grpo):\n        pass\n")
    with pytest.raises(ConfigError, match="must have `needs`"):
        make_loss_fn(grpo_config(policy_loss=f"{bad}:NoNeeds"))
