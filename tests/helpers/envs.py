"""Environments for the tests (``env.name=tests.helpers.envs:Name``)."""

from __future__ import annotations

from megatron_grpo.rewards.synthetic import synthetic_reward


class TwoTurns:
    """Answers the model's first turn with `` again=``, scores its second against the row's
    answer (per-character credit): every episode that is not cut short has two turns."""

    def __init__(self, row: dict) -> None:
        self.answer, self.turns = row["answer"], 0

    def step(self, text: str) -> tuple[str | None, float | None]:
        self.turns += 1
        if self.turns == 1:
            return " again=", None
        return None, synthetic_reward("", text, self.answer)
