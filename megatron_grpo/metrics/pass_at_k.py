"""pass@k, the share of prompts solved within k samples (Chen et al. 2021, arXiv 2107.03374,
eq. 1): with ``n`` samples of a prompt of which ``c`` are correct,
``pass@k = 1 - C(n-c, k) / C(n, k)``, averaged over prompts. Used by ``megatron-grpo eval``
(``evaluation/evaluate.py``) and the trainer's validation (``trainer/validation.py``).
"""

from __future__ import annotations

import math


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct: ``1 - C(n-c, k) / C(n, k)``
    (Chen et al. 2021, eq. 1). ``k <= n``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c({c}) <= n({n}) and 1 <= k({k}) <= n({n}).")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_pass_at_k(correct_PK: list[list[bool]], k: int) -> float:
    """pass@k averaged over prompts; ``correct_PK[p]`` holds prompt p's K sample outcomes."""
    vals = [pass_at_k(len(row), sum(row), k) for row in correct_PK]
    return sum(vals) / len(vals)
