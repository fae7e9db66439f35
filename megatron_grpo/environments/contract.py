"""What a user's environment is, and loading it from ``env.name``.

``ClassName(row)`` is built once per episode from the data row (a dict: ``prompt``,
``answer`` and every other key of the row); ``step(text) -> (reply, reward)`` gets the
model's last turn as decoded text (the stop string that ended it included) and returns the
environment's text to append (``None`` ends the episode) and a reward (a float, or ``None``).
The episode's reward is the last non-None reward it returned; without one, ``reward.name``
scores the whole transcript."""

from __future__ import annotations

import inspect
from typing import Any, Protocol

from megatron_grpo.config.plugins import load_object


class Environment(Protocol):
    def __init__(self, row: dict[str, Any]) -> None: ...

    def step(self, text: str) -> tuple[str | None, float | None]:
        """The model's last turn in; the environment's reply (None ends) and a reward."""
        ...


def load_environment(name: str) -> type:
    """The class ``env.name`` names, checked to be a class with a ``step`` method (one line
    naming the value and the fix otherwise)."""
    cls = load_object(name, "env", "ClassName", "env.name=my_env.py:CalculatorEnv")
    if not inspect.isclass(cls):
        raise ValueError(
            f"env.name={name!r} is a {type(cls).__name__}, not a class: name a class whose "
            "instances have step(text) -> (reply, reward)."
        )
    step = getattr(cls, "step", None)
    if not callable(step):
        raise ValueError(
            f"env.name={name!r}: class {cls.__name__} has no step method: define "
            "step(self, text) -> (reply or None, reward or None)."
        )
    return cls


def check_step_result(result: Any) -> tuple[str | None, float | None]:
    """``step``'s return value as ``(reply, reward)``, or ``TypeError`` saying what it was."""
    if not isinstance(result, tuple) or len(result) != 2:
        raise TypeError(
            f"step returned {type(result).__name__} {result!r:.80}; expected a tuple "
            "(reply: str or None, reward: float or None)"
        )
    reply, reward = result
    if reply is not None and not isinstance(reply, str):
        raise TypeError(f"step's reply is {type(reply).__name__}, expected str or None")
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise TypeError(f"step's reward is {type(reward).__name__}, expected float or None")
        reward = float(reward)
        if reward != reward:
            raise TypeError("step's reward is NaN")
    return reply, reward
