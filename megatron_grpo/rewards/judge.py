"""A judge model as the reward (``reward.name=judge:HF_DIR``): its settings, checks, prompt
and verdict, without an engine (docs/rewards-and-data.md, "A judge model as the reward").

The engine and its process are ``rollout/judge.py``: the run starts the judge beside the
process that scores and scores it through the remote reward's client (``rewards/remote.py``).
How a verdict becomes a reward:

- **choices** (``reward.judge_pattern`` empty, the default): the judge's log-probs of each
  choice continuing the rendered prompt (``reward.judge_choices``; ``reward.judge_values``,
  their rewards) give the reward ``sum_c softmax(logp)_c * value_c``, the expected value
  under the judge restricted to the choices. Every item gets one, from any model;
- **pattern**: the judge generates up to ``reward.judge_max_tokens`` tokens greedily and the
  first group of ``reward.judge_pattern`` (a regex) in its text is the reward, a number; a
  text without a match scores 0 and is counted (``unparsed``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

PREFIX = "judge:"
_FIELD = re.compile(r"{(\w+)}")


def is_judge(name: str) -> bool:
    """Whether ``reward.name`` names a judge model (``judge:HF_DIR``)."""
    return name.startswith(PREFIX)


@dataclass(frozen=True)
class JudgeSpec:
    """What the judge process needs (``reward.judge_*``, from the config)."""

    model: str
    template: str
    choices: tuple[str, ...]
    values: tuple[float, ...]
    pattern: str
    max_tokens: int
    max_model_len: int
    cpu_kv_cache_gb: float
    gpu_memory_utilization: float
    seed: int

    @classmethod
    def of(cls, reward_cfg: Any, cpu_kv_cache_gb: float = 1.0, seed: int = 0) -> JudgeSpec:
        """From ``reward.*`` (the judge's model is ``reward.name`` after ``judge:``); on CPU
        the engine's KV cache is ``cpu_kv_cache_gb`` (``rollout.cpu_kv_cache_gb``)."""
        r = reward_cfg
        return cls(
            model=r.name[len(PREFIX) :], template=r.judge_template,
            choices=tuple(r.judge_choices), values=tuple(float(v) for v in r.judge_values),
            pattern=r.judge_pattern, max_tokens=r.judge_max_tokens,
            max_model_len=r.judge_max_model_len, cpu_kv_cache_gb=cpu_kv_cache_gb,
            gpu_memory_utilization=r.judge_gpu_memory_utilization, seed=seed,
        )  # fmt: skip

    def check(self) -> None:
        """ValueError (one line, naming the key and the fix) for a judge that cannot run;
        cheap: before any rank or engine starts."""
        name = f"reward.name={PREFIX}{self.model}"
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(
                f"{name}: {self.model!r} has no config.json; point it at a Hugging Face model "
                "directory (the judge's weights and tokenizer)."
            )
        fields = set(_FIELD.findall(self.template))
        if "response" not in fields:
            raise ValueError(
                "reward.judge_template has no {response}: the judge would not see what it "
                "judges; write a template with {prompt}, {response} and {answer}."
            )
        if self.pattern:
            try:
                groups = re.compile(self.pattern).groups
            except re.error as e:
                raise ValueError(f"reward.judge_pattern={self.pattern!r} is not a regex ({e}).") from None  # fmt: skip
            if groups < 1:
                raise ValueError(
                    f"reward.judge_pattern={self.pattern!r} has no group: its first group is "
                    r"the reward, e.g. 'Score: ([01](?:\.\d+)?)'."
                )
        elif not self.choices or len(self.choices) != len(self.values):
            raise ValueError(
                f"reward.judge_choices={list(self.choices)} and reward.judge_values="
                f"{list(self.values)} must be as long as each other, and not empty: one reward "
                "per choice, e.g. [' yes', ' no'] and [1.0, 0.0]."
            )


def render(template: str, item: dict[str, Any]) -> str:
    """``template`` with each ``{key}`` replaced by ``item[key]`` (an unknown key stays as
    written: a template may show braces)."""
    return _FIELD.sub(lambda m: str(item.get(m.group(1), m.group(0))), template)


def expected_value(choice_logps: Sequence[float], values: Sequence[float]) -> float:
    """``sum_c softmax(logp)_c * value_c``: the choices' rewards weighted by the judge."""
    top = max(choice_logps)
    weights = [math.exp(lp - top) for lp in choice_logps]
    return sum(w * v for w, v in zip(weights, values)) / sum(weights)


def parse_verdict(pattern: str, text: str) -> float | None:
    """The number in ``pattern``'s first group in ``text``; None without one."""
    m = re.search(pattern, text)
    if m is None:
        return None
    try:
        return float(m.group(1))
    except (TypeError, ValueError):
        return None


def client_config(reward_cfg: Any, url: str) -> Any:
    """``reward.*`` for the remote reward that scores through the started judge at ``url``:
    its requests limited by ``judge_timeout_s`` (the judge answers a step's requests
    together) instead of ``timeout_s``."""
    return replace(reward_cfg, name=url, timeout_s=reward_cfg.judge_timeout_s)
