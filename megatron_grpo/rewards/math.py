"""MATH / DeepScaleR reward through ``math_verify`` (boxed answer first, then ``verify``).

The gold is parsed from ``\\boxed{<answer>}`` when the answer has no ``\\boxed`` of its own
(DeepScaleR stores bare answers such as ``\\frac{1}{2}``; MATH solutions carry a
``\\boxed{...}``). The response is parsed with boxed matches at top priority, then any
LaTeX/expression. math_verify's own signal-based timeouts are switched off
(``parsing_timeout=None``, ``timeout_seconds=None``): they only work in a main thread. This
function runs inside :class:`~megatron_grpo.rewards.pool.DeadlinePool` workers, whose
per-call deadline kills a stuck call instead.
"""

from __future__ import annotations

import functools
import logging

logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" notice


@functools.lru_cache(maxsize=1)
def _configs():
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str):
    from math_verify import parse

    text = answer if "\\boxed" in answer else "\\boxed{" + answer.strip().strip("$") + "}"
    return parse(text, extraction_config=_configs(), parsing_timeout=None)


def math_verify_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 when math_verify finds the response's answer equivalent to the gold, else 0.0."""
    from math_verify import parse, verify

    gold = _parse_gold(answer)
    if not gold:
        raise ValueError(f"gold answer {answer[:200]!r} cannot be parsed by math_verify")
    pred = parse(response, extraction_config=_configs(), parsing_timeout=None)
    if not pred:
        return 0.0
    return float(verify(gold, pred, timeout_seconds=None))


# Run once in each pool worker before it reports ready (first-call grammar setup is slow).
math_verify_reward.warmup_args = ("", "\\boxed{\\frac{1}{2}}", "\\frac{1}{2}")  # type: ignore[attr-defined]


def math_format(response: str) -> float:
    """Format reward: 1.0 when the response has a ``\\boxed{...}``."""
    return float("\\boxed{" in response)
