"""Algorithm math: pure tensor functions plus builders that pick a variant once.

- :mod:`.advantages` — group advantages (GRPO, Dr.GRPO, RED-Weight, RED-Drop, zero-variance).
- :mod:`.losses` — per-token policy losses (off-policy clip, REC, GSPO), TIS, regularizers.
- :mod:`.kl` — k1/k2/k3 estimators, KL in the reward.
- :mod:`.aggregation` — global-normalizer aggregation and the trainer's ``loss_fn`` contract.
- :mod:`.shaping` — DAPO overlong penalty and filter.
"""

from megatron_grpo.algorithms.advantages import Advantages, build_advantage_fn
from megatron_grpo.algorithms.aggregation import compute_global_normalizers, make_loss_fn
from megatron_grpo.algorithms.kl import get_kl_estimator, kl_penalized_rewards
from megatron_grpo.algorithms.policy_loss import build_policy_loss

__all__ = [
    "Advantages",
    "build_advantage_fn",
    "build_policy_loss",
    "compute_global_normalizers",
    "get_kl_estimator",
    "kl_penalized_rewards",
    "make_loss_fn",
]
