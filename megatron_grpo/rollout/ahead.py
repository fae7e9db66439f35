"""Generate a sync window's batches ahead of the trainer (``rollout.ahead``; docs/rollout.md).

In Algorithm 1 (Mroueh et al., arXiv 2505.22257) vLLM serves alpha = pi_k for the whole
window k+1..k+v: no batch of the window depends on the training inside it. So when step s
needs its batch and none is buffered, the batches of steps ``window_steps(s, a, v, steps)``
(s, s+1, ... up to s+a, never past the next sync step) can be produced at once:

- prompts are drawn from the data stream in step order, exactly as the serial loop draws
  them, and each step keeps its own sampling seed ``rollout.seed + 7919 * step``
  (``algorithms.seeds.sampling_seed``);
- **colocated** (``rollout.colocated.ColocatedRollout.launch``): one vLLM ``generate`` call
  carries all those steps' prompts, each request with the seed its own step's call would
  give it (``RolloutEngine.generate(seeds=...)``);
  vLLM then runs one large batch instead of a+1 small ones. On CPU vLLM is not
  batch-invariant, so a response can differ from the serial schedule's (docs/rollout.md);
- **disaggregated** (``rollout.client.RolloutClient.launch``): the steps' generate commands
  are queued back to back on the engines and the trainer collects step s+j's samples when it asks for
  them, so the engines generate while the trainer trains. Each step is its own vLLM call
  with its own seed: the samples are those of the serial schedule, bit for bit.

Checkpoints save the data position of the *consumed* steps (``data_state``): a resume in
the middle of a window draws and regenerates what had been buffered.

**Dynamic sampling** (``grpo.dynamic_sampling``; ``algorithms.dynamic_sampling``): each step
draws ``ceil(oversample * prompts_per_step)`` prompts for its own generation, as above. When
the step is taken and fewer than ``prompts_per_step`` of its groups have rewards that differ,
``take`` runs further rounds of as many prompts, each sampled from the same served weights as
the step (no sync happens before the step is trained) with the seed ``round_seed(step, r)``,
until the batch is full or ``max_rounds`` is reached. The further rounds draw from a second
pass over the data (``PromptSource.reshuffled``), consumed in step order whatever
``rollout.ahead`` is, so a checkpoint saves its position too and a resumed run draws the same
rounds. A round goes through the arrivals thread like a step (the engines run requests in
order, so it waits behind the window's queued steps either way).
"""

from __future__ import annotations

import math
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from megatron_grpo.algorithms.dynamic_sampling import Round, fill_batch, signal_count
from megatron_grpo.algorithms.seeds import refill_shuffle_seed, round_seed, sampling_seed
from megatron_grpo.config.schema import DynamicSamplingConfig


def window_steps(step: int, ahead: int, sync_interval: int, total_steps: int) -> list[int]:
    """Steps whose batches are generated together when step ``step`` needs its batch and none
    is buffered: ``step .. min(step + ahead, next sync step, total_steps)``.

    With v = ``sync_interval`` the sync after step k happens when ``k % v == 0`` (after
    training step k), so the batches of steps ``(j-1)*v+1 .. j*v`` all come from the same
    served weights; the next sync step of ``step`` is ``ceil(step / v) * v``."""
    if ahead < 0 or sync_interval < 1 or not 1 <= step <= total_steps:
        raise ValueError(
            f"window_steps(step={step}, ahead={ahead}, sync_interval={sync_interval}, "
            f"total_steps={total_steps}): need ahead >= 0, sync_interval >= 1 and "
            "1 <= step <= total_steps."
        )
    return steps_through(step, ahead, -(-step // sync_interval) * sync_interval, total_steps)


def steps_through(step: int, ahead: int, window_end: int, total_steps: int) -> list[int]:
    """``step .. min(step + ahead, window_end, total_steps)``: ``window_end`` is the last step
    certain to be sampled from the weights served now (``trainer.sync_schedule``)."""
    if window_end < step:
        raise ValueError(
            f"window_end={window_end} is before step {step}: the window must "
            "hold the step that asks for its batch."
        )
    return list(range(step, min(step + ahead, window_end, total_steps) + 1))


@dataclass
class _Buffered:
    step: int
    prompts: list
    data_state_before: dict
    samples: Future = field(default_factory=Future)
    """The step's samples where this rank receives them (all engines', prompt-major)."""
    scores: Future = field(default_factory=Future)
    """``score(prompts, samples)`` of them, computed as soon as they arrive."""


Launch = Callable[[list[Any]], list[Callable[[], list | None]]]
"""``launch([(prompt_ids, seed[, rows]) per step])`` starts the steps' generation and returns one
thunk per step that yields its samples (``Rollout.launch``): local, no collective, so a
background thread may call it; None on a rank that does not receive them."""


def _call(fn: Callable[[], Any]) -> Any:
    return fn()


class WindowBuffer:
    """The window buffer: the loop's source of each step's batch (``take``) and its rewards
    (``take_scores``), prefetched within one sync window. ``ahead=0`` generates one step at a
    time, Algorithm 1's serial schedule. It is not a ``Rollout`` but sits on one: it calls
    ``Rollout.launch`` / ``share`` and hands the loop whole steps (prompts, samples, rewards),
    where a ``Rollout`` answers generate calls.

    ``launch``: the rollout interface's ``launch`` with the run's sampling settings bound;
    ``score(prompts, samples) -> (rewards, info)`` (``rewards.scoring.GroupScorer``); a
    background thread collects each step's samples in order as they arrive and scores them
    at once, so a step's rewards are usually ready before the trainer asks (off its
    critical path). ``share(fn)``: ``fn()``'s result on every trainer rank, evaluated where
    the samples arrive (``Rollout.share``; collective, so called on the loop's thread only).
    ``window_end(step)``: the last step certain to be sampled from the weights served now
    (``trainer.sync_schedule.SyncSchedule.window_end``); None: the next multiple of
    ``sync_interval``, Algorithm 1's fixed schedule."""

    def __init__(self, prompts: Any, prompts_per_step: int, ahead: int, sync_interval: int,
                 total_steps: int, rollout_seed: int, launch: Launch,
                 score: Callable[[list, list], Any] | None = None,
                 share: Callable[[Callable[[], Any]], Any] = _call,
                 window_end: Callable[[int], int] | None = None,
                 with_rows: bool = False,
                 dynamic: DynamicSamplingConfig | None = None) -> None:  # fmt: skip
        self.prompts, self.launch, self.score, self.share = prompts, launch, score, share
        self.with_rows = with_rows
        """Multi-turn episodes (``env.name``): each step's data rows go with its prompts."""
        self.dynamic = None
        """``grpo.dynamic_sampling`` when on: rounds per step, groups with signal kept."""
        self.round_size = prompts_per_step
        """Prompts per generation of a step (dynamic sampling: ``ceil(oversample * P)``)."""
        self.refill = None
        """Dynamic sampling: the second data pass its further rounds draw from."""
        if dynamic is not None and dynamic.enabled:
            if score is None:
                raise ValueError("dynamic sampling picks groups by their rewards: pass score.")
            self.dynamic = dynamic
            self.round_size = math.ceil(prompts_per_step * dynamic.oversample)
            self.refill = prompts.reshuffled(refill_shuffle_seed(prompts.seed))
        self._scores: Any = None
        self.window_end = window_end
        self.prompts_per_step, self.ahead = prompts_per_step, ahead
        self.sync_interval, self.total_steps = sync_interval, total_steps
        self.rollout_seed = rollout_seed
        self._buffer: deque[_Buffered] = deque()
        self._taken: _Buffered | None = None
        self._arrivals: queue.SimpleQueue | None = None

    def take(self, step: int) -> tuple[list, list]:
        """Step ``step``'s ``(prompts, samples)``; generates the window ahead when empty."""
        if not self._buffer:
            self._fill(step)
        head = self._buffer[0]
        if head.step != step:
            raise RuntimeError(
                f"rollout.ahead: the trainer asked for step {step}'s batch but step "
                f"{head.step}'s is next in the buffer; steps must be consumed in order."
            )
        samples = self.share(head.samples.result)
        self._buffer.popleft()
        self._taken = head
        if self.dynamic is None:
            return head.prompts, samples
        rounds = [Round(head.prompts, samples, *self.share(head.scores.result))]
        while (
            signal_count(rounds) < self.prompts_per_step and len(rounds) < self.dynamic.max_rounds
        ):
            rounds.append(self._round(step, len(rounds)))
        prompts, samples, self._scores = fill_batch(rounds, self.prompts_per_step)
        return prompts, samples

    def take_scores(self) -> Any:
        """The rewards ``score`` gave the batch ``take`` returned last (waits for them)."""
        assert self._taken is not None, "take_scores before take"
        if self.dynamic is not None:
            return self._scores
        return self.share(self._taken.scores.result)

    def _round(self, step: int, round_: int) -> Round:
        """Dynamic sampling's round ``round_`` of step ``step``: new prompts from the second
        data pass, generated and scored on the arrivals thread (after the queued steps)."""
        assert self.refill is not None and self._arrivals is not None
        prompts = self.refill.next_batch(self.round_size)
        entry = _Buffered(step, prompts, {})
        seed = round_seed(self.rollout_seed, step, round_)
        self._arrivals.put(([entry], self.launch([self._request(prompts, seed)])))
        samples = self.share(entry.samples.result)
        return Round(prompts, samples, *self.share(entry.scores.result))

    def data_state(self) -> dict:
        """The data position after the consumed steps (what a checkpoint must save); with
        dynamic sampling, its second pass's position under ``refill``."""
        state = self._buffer[0].data_state_before if self._buffer else self.prompts.state_dict()
        if self.refill is not None:
            return {**state, "refill": self.refill.state_dict()}
        return state

    def load_data_state(self, state: dict) -> None:
        """Continue the data stream from ``state`` (a checkpoint's ``data_state``, what
        ``data_state`` returned when it was saved); before the first ``take``."""
        if self._buffer or self._taken is not None:
            raise RuntimeError(
                "load_data_state after take: the buffer already holds batches "
                "drawn from the old position."
            )
        state = dict(state)
        refill = state.pop("refill", None)
        self.prompts.load_state_dict(state)
        if self.refill is not None and refill is not None:
            self.refill.load_state_dict(refill)

    def _fill(self, step: int) -> None:
        if self.window_end is None:
            steps = window_steps(step, self.ahead, self.sync_interval, self.total_steps)
        else:
            steps = steps_through(step, self.ahead, self.window_end(step), self.total_steps)
        drawn = []
        for s in steps:  # data stream in step order, as the serial loop draws it
            before = self.prompts.state_dict()
            drawn.append((s, self.prompts.next_batch(self.round_size), before))
        thunks = self.launch(
            [self._request(ps, sampling_seed(self.rollout_seed, s)) for s, ps, _ in drawn]
        )
        window = [_Buffered(s, ps, before) for s, ps, before in drawn]
        self._buffer.extend(window)
        if self._arrivals is None:
            # One thread for the run, not one per window: a reward worker it replaces has a
            # parent-death signal tied to the thread that started it (platform/lifetime.py).
            self._arrivals = queue.SimpleQueue()
            threading.Thread(
                target=self._arrivals_thread,
                args=(self._arrivals,),
                name="rollout-arrivals",
                daemon=True,
            ).start()
        self._arrivals.put((window, thunks))

    def _request(self, prompts: list, seed: int) -> tuple:
        """What ``launch`` takes of one generation: ``(prompt_ids, seed[, rows])``."""
        ids = [p.prompt_ids for p in prompts]
        return (ids, seed, [p.row for p in prompts]) if self.with_rows else (ids, seed)

    def _arrivals_thread(self, arrivals: queue.SimpleQueue) -> None:
        while True:
            self._arrive(*arrivals.get())

    def _arrive(self, window: list[_Buffered], thunks: list[Callable[[], Any]]) -> None:
        """In step order: wait for a step's samples, publish them, score them."""
        for i, (entry, thunk) in enumerate(zip(window, thunks, strict=True)):
            try:
                samples = thunk()
            except BaseException as e:  # noqa: BLE001 - raised in the loop by take()
                for rest in window[i:]:
                    rest.samples.set_exception(e)
                    rest.scores.set_exception(e)
                return
            entry.samples.set_result(samples)
            try:
                scored = None if samples is None or self.score is None else (
                    self.score(entry.prompts, samples))  # fmt: skip
                entry.scores.set_result(scored)
            except BaseException as e:  # noqa: BLE001 - raised in the loop by take_scores()
                entry.scores.set_exception(e)
