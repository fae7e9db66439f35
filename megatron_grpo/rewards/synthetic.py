"""Synthetic tasks that a tiny random char-level model can learn with GRPO on a CPU.

Each task makes ``(prompt, answer)`` pairs from a seeded generator; the verifier is exact.
Every character is in the tiny model's vocabulary (``models/tiny.py`` CHARSET). Tasks, with
``d`` the difficulty (``data.synthetic_difficulty``):

- ``add``: ``"a+b="`` -> ``str(a + b)``, ``a, b`` uniform in ``[0, 10**d)``. The default; at
  d=1 there are 100 problems with 1-2 digit answers.
- ``copy``: ``"copy 3814="`` -> ``"3814"`` (``d + 2`` digits).
- ``reverse``: ``"rev 3814="`` -> ``"4183"`` (``d + 2`` digits).
- ``max``: ``"max 3 8 1="`` -> ``"8"`` (``d + 1`` digits).
- ``sum``: ``"sum 12 45="`` -> ``"57"`` (two numbers of ``d + 1`` digits): too
  long for a tiny model to add in its head, and learnable with the calculator tool
  (``configs/tiny_tools_cpu.yaml``, docs/environments.md). Its warm-start demonstrations
  (:func:`warm_start_target`) call the tool in every other example and answer directly in
  the others, so GRPO starts from a model that sometimes uses the tool.

Reward (:func:`synthetic_reward`), designed so a 2-layer 128-wide model gets signal from its
first GRPO steps: per-character credit ``#{i : resp[i] == ans[i]} / max(len(resp), len(ans))``
on the stripped response. An exact answer scores 1.0; the right first digit of a two-digit
sum scores 0.5; extra characters after the answer lower the score (so the model learns to
stop). The format reward (:func:`synthetic_format`) is 1.0 for a non-empty all-digit response.

Examples are deterministic: example ``i`` of ``(task, d, split)`` comes from
``random.Random(f"{task}|{d}|{split}|{i}")`` (string seeds hash with SHA-512, stable across
runs and ``PYTHONHASHSEED``).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass


def _digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(n))


def _add(rng: random.Random, d: int) -> tuple[str, str]:
    a, b = rng.randrange(10**d), rng.randrange(10**d)
    return f"{a}+{b}=", str(a + b)


def _copy(rng: random.Random, d: int) -> tuple[str, str]:
    s = _digits(rng, d + 2)
    return f"copy {s}=", s


def _reverse(rng: random.Random, d: int) -> tuple[str, str]:
    s = _digits(rng, d + 2)
    return f"rev {s}=", s[::-1]


def _max(rng: random.Random, d: int) -> tuple[str, str]:
    xs = _digits(rng, d + 1)
    return "max " + " ".join(xs) + "=", max(xs)


def _sum(rng: random.Random, d: int) -> tuple[str, str]:
    xs = [rng.randrange(10**d, 10 ** (d + 1)) for _ in range(2)]
    return "sum " + " ".join(map(str, xs)) + "=", str(sum(xs))


def _sum_demo(prompt: str, answer: str, index: int) -> str:
    """Every other example calls the calculator (``environments.calculator.TinyCalculator``'s
    markers: ``<12+45>``, its answer ``=57;``), the others answer directly."""
    if index % 2:
        return answer
    expression = "+".join(prompt.removeprefix("sum ").removesuffix("=").split())
    return f"<{expression}>={answer};{answer}"


@dataclass(frozen=True)
class SyntheticTask:
    name: str
    make: Callable[[random.Random, int], tuple[str, str]]
    """``make(rng, difficulty) -> (prompt, answer)``."""
    demo: Callable[[str, str, int], str] | None = None
    """``demo(prompt, answer, index)``: the warm start's target for an example, where it
    is not the answer itself (``warm_start_target``)."""


TASKS: dict[str, SyntheticTask] = {
    t.name: t
    for t in (
        SyntheticTask("add", _add),
        SyntheticTask("copy", _copy),
        SyntheticTask("reverse", _reverse),
        SyntheticTask("max", _max),
        SyntheticTask("sum", _sum, demo=_sum_demo),
    )
}


def get_task(name: str) -> SyntheticTask:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(
            f"synthetic task {name!r} is unknown: set data.source to one of "
            f"{[f'synthetic:{n}' for n in TASKS]}."
        ) from None


def synthetic_example(
    task: str, difficulty: int, index: int, split: str = "train"
) -> tuple[str, str]:
    """Example ``index`` of a task: ``(prompt, answer)``, the same on every run."""
    rng = random.Random(f"{task}|{difficulty}|{split}|{index}")
    return get_task(task).make(rng, difficulty)


def warm_start_target(source: str, prompt: str, answer: str, index: int) -> str:
    """What the supervised warm start (``model.warm_start_steps``) teaches for an example of
    ``data.source``: the answer, or the task's demonstration (``SyntheticTask.demo``)."""
    if not source.startswith("synthetic:"):
        return answer
    demo = get_task(source.split(":", 1)[1]).demo
    return answer if demo is None else demo(prompt, answer, index)


def char_match_score(response: str, answer: str) -> float:
    """``#{i : resp[i] == ans[i]} / max(len(resp), len(ans))``; 1.0 only for an exact match."""
    resp = response.strip()
    denom = max(len(resp), len(answer))
    if denom == 0:
        return 1.0
    return sum(a == b for a, b in zip(resp, answer)) / denom


def synthetic_reward(prompt: str, response: str, answer: str) -> float:
    """Per-character partial credit against the exact answer (see the module docstring)."""
    return char_match_score(response, answer)


_DIGITS = re.compile(r"-?\d+")


def synthetic_format(response: str) -> float:
    """Format reward: 1.0 for a non-empty all-digit response (after stripping)."""
    return float(_DIGITS.fullmatch(response.strip()) is not None)
