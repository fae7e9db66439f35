"""GSM8K reward: gold is the text after ``####``; strict or flexible answer extraction.

- strict (``reward.name=gsm8k``): the response must contain ``#### <number>``; the first
  such number is the answer (lm-eval-harness ``strict-match``).
- flexible (``gsm8k_flexible``): the last number anywhere in the response.

Numbers are compared exactly after removing ``,`` and ``$`` and a trailing ``.``
(``1,000.`` == ``1000`` == ``1000.00``) using ``Decimal``, which has no digit limit and is
linear in the input. Every regex here is linear-time (no nested or overlapping
quantifiers), so a crafted response cannot stall the trainer; this reward runs in-process.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A number starts with a digit (so runs of "," or "$" cannot trigger backtracking).
_NUM = r"-?\$?\d[\d,]*(?:\.\d+)?"
_STRICT = re.compile(r"####\s*(" + _NUM + ")")
_ANY_NUM = re.compile(_NUM)


def normalize_number(text: str) -> str:
    """Strip ``,``, ``$``, spaces and a trailing ``.``; ``'$1,000.'`` -> ``'1000'``."""
    return text.replace(",", "").replace("$", "").strip().rstrip(".")


def numbers_equal(a: str, b: str) -> bool:
    """Exact numeric equality of two number strings (falls back to string equality)."""
    a, b = normalize_number(a), normalize_number(b)
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return a == b


def extract_gold(answer: str) -> str:
    """GSM8K gold: the text after the last ``####``; an answer without one is the gold itself."""
    gold = answer.rsplit("####", 1)[-1] if "####" in answer else answer
    return normalize_number(gold)


def extract_strict(response: str) -> str | None:
    """The number of the first ``#### <number>`` in the response, or None."""
    m = _STRICT.search(response)
    return m.group(1) if m else None


def extract_flexible(response: str) -> str | None:
    """The last number in the response, or None."""
    last = None
    for m in _ANY_NUM.finditer(response):
        last = m.group(0)
    return last


def gsm8k_strict(prompt: str, response: str, answer: str) -> float:
    """1.0 when ``#### <number>`` in the response equals the gold, else 0.0."""
    pred = extract_strict(response)
    return float(pred is not None and numbers_equal(pred, extract_gold(answer)))


def gsm8k_flexible(prompt: str, response: str, answer: str) -> float:
    """1.0 when the last number in the response equals the gold, else 0.0."""
    pred = extract_flexible(response)
    return float(pred is not None and numbers_equal(pred, extract_gold(answer)))


def gsm8k_format(response: str) -> float:
    """Format reward: 1.0 when the response has a ``#### <number>`` line."""
    return float(extract_strict(response) is not None)
