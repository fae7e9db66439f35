"""``build_reward(reward_cfg, data_cfg) -> RewardFn``: batched, time-limited, never raising.

``RewardFn(prompts, responses, answers) -> (rewards, info)`` scores a batch:
``reward = task_score + reward.format_weight * format_score``. A call that raises scores 0
and is counted (``info["errors"]``), a call past ``reward.timeout_s`` scores 0 and is counted
(``info["timeouts"]``); the first error and the first timeout are logged once, with their
input. Nothing a response contains can stop or stall the run.

Where calls run:

- ``gsm8k``, ``gsm8k_flexible``, ``synthetic``: in-process. Their regexes are linear-time and
  their comparisons use ``Decimal``/string equality, so their cost is linear in the input
  (the adversarial tests check a 100k-digit number and deep nesting stay far under the limit);
  a per-call check still counts any call that exceeds ``timeout_s`` as a timeout.
- ``math`` and user functions ``package.module:function``: in a
  :class:`~megatron_grpo.rewards.pool.DeadlinePool` of ``reward.num_workers`` processes, whose
  worker is killed and replaced when a call overruns ``timeout_s``. Call :meth:`RewardFn.close`
  (or use ``with``) to stop them.
- ``http://HOST:PORT/PATH`` / ``https://...``: a :class:`~megatron_grpo.rewards.remote.RemoteReward`
  POSTs the batch to a server, ``reward.concurrency`` requests of ``reward.batch_size``
  items in flight; each item carries its data row's other keys (``rows``). A request that
  fails (retries spent, a bad answer) scores its items 0 as errors, one past ``timeout_s``
  as timeouts. ``check_reward`` POSTs an empty batch, so an unreachable server is refused
  before anything starts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypedDict

from megatron_grpo.rewards.gsm8k import gsm8k_flexible, gsm8k_format, gsm8k_strict
from megatron_grpo.rewards.judge import JudgeSpec, is_judge
from megatron_grpo.rewards.math import math_format
from megatron_grpo.rewards.pool import DeadlinePool, Outcome, load_callable
from megatron_grpo.rewards.remote import RemoteReward, check_url, is_remote
from megatron_grpo.rewards.synthetic import synthetic_format, synthetic_reward

log = logging.getLogger(__name__)

ScoreFn = Callable[[str, str, str], float]

# name -> (in-process score fn or pool target path, format fn)
_INPROCESS: dict[str, tuple[ScoreFn, Callable[[str], float]]] = {
    "gsm8k": (gsm8k_strict, gsm8k_format),
    "gsm8k_flexible": (gsm8k_flexible, gsm8k_format),
    "synthetic": (synthetic_reward, synthetic_format),
}
_POOLED: dict[str, tuple[str, Callable[[str], float]]] = {
    "math": ("megatron_grpo.rewards.math:math_verify_reward", math_format),
}


def _short(x: str, n: int = 300) -> str:
    return x if len(x) <= n else x[:n] + f"...<{len(x) - n} more chars>"


class RewardInfo(TypedDict):
    """What scoring one batch counted, beside its rewards."""

    errors: int
    timeouts: int
    total_errors: int
    total_timeouts: int
    task_mean: float
    format_mean: float
    reward_mean: float
    task_scores: list[float]


class RewardFn:
    """Batched reward; see the module docstring. Counters accumulate over the run."""

    def __init__(
        self,
        name: str,
        timeout_s: float,
        format_weight: float,
        format_fn: Callable[[str], float] | None,
        score_fn: ScoreFn | None = None,
        pool: DeadlinePool | None = None,
        remote: RemoteReward | None = None,
    ) -> None:
        if sum(x is not None for x in (score_fn, pool, remote)) != 1:
            raise ValueError("RewardFn needs exactly one of score_fn (in-process), pool or remote.")
        self.name, self.timeout_s = name, timeout_s
        self.format_weight, self.format_fn = format_weight, format_fn
        self._score_fn, self._pool, self._remote = score_fn, pool, remote
        self.total_errors = 0
        self.total_timeouts = 0
        self._logged: set[str] = set()
        # The loop scores batches from its arrivals thread while validation may score on the
        # main thread: one call at a time (the pool and the counters are shared).
        self._lock = threading.Lock()

    def _run_inprocess(self, args: list[tuple[str, str, str]]) -> list[Outcome]:
        out = []
        for a in args:
            t0 = time.monotonic()
            try:
                value = float(self._score_fn(*a))  # type: ignore[misc]
            except Exception as e:  # noqa: BLE001 - a reward bug must not kill the run
                out.append(Outcome("error", detail=f"{type(e).__name__}: {str(e)[:500]}"))
                continue
            took = time.monotonic() - t0
            if took > self.timeout_s:
                out.append(Outcome("timeout", detail=f"took {took:.2f}s > {self.timeout_s}s"))
            else:
                out.append(Outcome("ok", value))
        return out

    def __call__(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        answers: Sequence[str],
        rows: Sequence[dict[str, Any]] | None = None,
    ) -> tuple[list[float], RewardInfo]:
        """``rows[i]``: the data row of response ``i`` (``data.Prompt.row``); only a remote
        reward reads it (its other keys ride along in the item)."""
        if not len(prompts) == len(responses) == len(answers):
            raise ValueError(
                f"reward batch lengths differ: {len(prompts)} prompts, {len(responses)} "
                f"responses, {len(answers)} answers; pass one answer per response."
            )
        if rows is not None and len(rows) != len(responses):
            raise ValueError(f"{len(rows)} data rows for {len(responses)} responses: pass one "
                             "row per response, or none.")  # fmt: skip
        args = [(str(p), str(r), str(a)) for p, r, a in zip(prompts, responses, answers)]
        with self._lock:
            return self._score(args, rows)

    def _score(
        self, args: list[tuple[str, str, str]], rows: Sequence[dict[str, Any]] | None = None
    ) -> tuple[list[float], RewardInfo]:
        if self._remote is not None:
            outcomes = self._remote.map(args, rows)
        elif self._pool is not None:
            outcomes = self._pool.map(args)
        else:
            outcomes = self._run_inprocess(args)
        rewards, task, fmt = [], [], []
        errors = timeouts = 0
        for a, o in zip(args, outcomes):
            if o.status != "ok":
                errors += o.status == "error"
                timeouts += o.status == "timeout"
                if o.status not in self._logged:
                    self._logged.add(o.status)
                    log.warning(
                        "reward %s: %s (%s) on prompt=%r response=%r answer=%r; it scores 0. "
                        "Further %ss are counted in the metrics, not logged.",
                        self.name,
                        o.status,
                        o.detail,
                        _short(a[0]),
                        _short(a[1]),
                        _short(a[2]),
                        o.status,
                    )
            f = self.format_fn(a[1]) if self.format_fn is not None and self.format_weight else 0.0
            score = o.value if o.status == "ok" else 0.0
            task.append(score)
            fmt.append(f)
            rewards.append(score + self.format_weight * f)
        self.total_errors += errors
        self.total_timeouts += timeouts
        n = max(len(rewards), 1)
        info: RewardInfo = {
            "errors": errors,
            "timeouts": timeouts,
            "total_errors": self.total_errors,
            "total_timeouts": self.total_timeouts,
            "task_mean": sum(task) / n,
            "format_mean": sum(fmt) / n,
            "reward_mean": sum(rewards) / n,
            # Per response, without the format bonus: "correct" means a task score of 1.
            "task_scores": task,
        }
        return rewards, info

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
        if self._remote is not None:
            self._remote.close()

    def __enter__(self) -> RewardFn:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_reward(reward_cfg, data_cfg=None) -> None:
    """Every check ``build_reward`` makes, without starting anything (ValueError, one line):
    run it before expensive work. A user function is imported here, in this process."""
    name = reward_cfg.name
    src = getattr(data_cfg, "source", "") or ""
    if src.startswith("synthetic:") and name in ("gsm8k", "gsm8k_flexible", "math"):
        raise ValueError(
            f"data.source={src!r} pairs with reward.name=synthetic, not {name!r}: set "
            "reward.name=synthetic or use a GSM8K/MATH data file."
        )
    if name in _INPROCESS or name in _POOLED:
        return
    if is_judge(name):
        _check_no_format(reward_cfg, "judge")
        JudgeSpec.of(reward_cfg).check()
        return
    if is_remote(name):
        _check_no_format(reward_cfg, "remote")
        check_url(name)
        remote = _remote(reward_cfg)
        try:
            remote.probe()
        finally:
            remote.close()
        return
    if ":" not in name:
        raise ValueError(
            f"reward.name={name!r} is neither a built-in reward {sorted([*_INPROCESS, *_POOLED])} "
            "nor 'package.module:function' / 'path/to/file.py:function'."
        )
    _check_no_format(reward_cfg, "user")
    load_callable(name)


def _check_no_format(reward_cfg, kind: str) -> None:
    if reward_cfg.format_weight:
        raise ValueError(
            f"reward.format_weight={reward_cfg.format_weight} has no format check for the "
            f"{kind} reward {reward_cfg.name!r}: fold the format into the "
            f"{ {'remote': 'server', 'judge': 'template'}.get(kind, 'function') } and set "
            "reward.format_weight=0."
        )


def _remote(reward_cfg) -> RemoteReward:
    r = reward_cfg
    return RemoteReward(r.name, r.timeout_s, r.concurrency, r.batch_size, r.retries, r.backoff_s)


def build_reward(reward_cfg, data_cfg=None) -> RewardFn:
    """The reward of ``reward.name`` (see :class:`~megatron_grpo.config.schema.RewardConfig`).

    ``data_cfg`` is checked against the reward: a ``synthetic:<task>`` source needs
    ``reward.name=synthetic`` (or a user function) because its answers are bare strings.
    A user function is ``package.module:function`` or ``path/to/file.py:function``.
    """
    check_reward(reward_cfg, data_cfg)  # fail now, in the parent, with a clear message
    name = reward_cfg.name
    if is_judge(name):
        raise ValueError(
            f"reward.name={name!r}: a judge is started by the run that scores with it "
            "(rollout/judge.py start_judge), then built as the remote reward at its URL "
            "(rewards.judge.client_config)."
        )
    common = dict(name=name, timeout_s=reward_cfg.timeout_s, format_weight=reward_cfg.format_weight)
    if name in _INPROCESS:
        score, fmt = _INPROCESS[name]
        return RewardFn(format_fn=fmt, score_fn=score, **common)
    if name in _POOLED:
        target, fmt = _POOLED[name]
        pool = DeadlinePool(target, reward_cfg.num_workers, reward_cfg.timeout_s)
        return RewardFn(format_fn=fmt, pool=pool, **common)
    if is_remote(name):
        return RewardFn(format_fn=None, remote=_remote(reward_cfg), **common)
    pool = DeadlinePool(name, reward_cfg.num_workers, reward_cfg.timeout_s)
    return RewardFn(format_fn=None, pool=pool, **common)
