"""Reward shaping before the advantages: DAPO overlong penalty and overlong filter.

DAPO (Yu et al. 2503.14476, eq. 13) "soft overlong punishment": with ``L_max`` the maximum
response length and ``L_cache`` the buffer,

    R_len(L) = 0                              if L <= L_max - L_cache
             = ((L_max - L_cache) - L) / L_cache * penalty   if L_max - L_cache < L <= L_max
             = -penalty                       if L > L_max

Responses are capped at ``L_max`` by the sampler, so a truncated response (no EOS) has
``L = L_max`` and gets ``-penalty``. The overlong filter instead gives truncated responses no
gradient (``keep = ~truncated``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths_B: Tensor, max_len: int, buffer: int, penalty: float) -> Tensor:
    """DAPO soft overlong penalty ``[B]`` (<= 0) for response lengths ``lengths_B`` ``[B]``."""
    if buffer <= 0 or buffer > max_len:
        raise ValueError(
            f"overlong buffer={buffer} must be in [1, max_len={max_len}]: set grpo.overlong_buffer "
            "within the response length, or 0 to disable shaping."
        )
    start = max_len - buffer
    over = (lengths_B.to(torch.float32) - start).clamp(min=0)
    return -(over / buffer).clamp(max=1.0) * penalty


def overlong_filter_keep(truncated_B: Tensor) -> Tensor:
    """``[B]`` bool: False for responses cut at the length limit (DAPO overlong filtering)."""
    return ~truncated_B.bool()


def shape_rewards(
    rewards_PG: Tensor, lengths_B: Tensor, max_len: int, buffer: int, penalty: float
) -> Tensor:
    """``grpo.overlong_buffer > 0``: rewards plus the DAPO penalty of each response length
    (``[P, G]``, batch order ``(p, g) = divmod(b, G)``); ``buffer == 0`` returns them as is."""
    if buffer == 0:
        return rewards_PG
    return rewards_PG + overlong_penalty(lengths_B, max_len, buffer, penalty).view_as(rewards_PG)
