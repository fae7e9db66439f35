"""CISPO (MiniMax-M1, arXiv 2506.13585) written as a user's loss, the worked example of
docs/algorithms.md, "Write your own loss"; tests/algorithms/test_custom_loss.py runs it.

CISPO keeps every token's gradient and clips the importance weight instead of the update:
``loss_t = -sg(min(r_t, 1 + eps_high)) * A * log pi(y_t)``, ``r_t = pi / pi_old``.

Use it with ``grpo.loss.policy_loss=docs/examples/cispo_loss.py:Cispo``: the trainer builds
``Cispo(grpo)`` once, reads ``needs`` to know which log-probs to score, and calls the
instance per micro-batch; ``grpo.off_policy.tis``, the regularizer, the KL and the
aggregation compose around it as around the built-in losses.
"""

from __future__ import annotations

from torch import Tensor

from megatron_grpo.algorithms.losses import masked_mean, ratio_exp
from megatron_grpo.algorithms.policy_loss import Role, RoleLogprobs
from megatron_grpo.config.schema import GRPOConfig


class Cispo:
    def __init__(self, grpo: GRPOConfig) -> None:
        self.eps_high = grpo.loss.clip_eps_high
        # pi_old: pi_k scored on the trainer under ratio_mode=exact, else alpha as served
        self.pi_old = Role.PI_K if grpo.off_policy.ratio_mode == "exact" else Role.ALPHA_ENGINE
        self.needs = frozenset({self.pi_old})  # the trainer scores exactly these

    def __call__(
        self, logp_BT: Tensor, *, adv: Tensor, mask_BT: Tensor, lp: RoleLogprobs
    ) -> tuple[Tensor, dict[str, Tensor]]:
        ratio = ratio_exp(logp_BT.detach() - lp.of(self.pi_old))
        weight = ratio.clamp(max=1.0 + self.eps_high)  # detached: it weighs, never steers
        loss = -weight * adv[:, None] * logp_BT
        clipped = (ratio > 1.0 + self.eps_high).float()
        return loss, {"cispo_clip_frac": masked_mean(clipped, mask_BT)}
