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
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from megatron_grpo.algorithms.seeds import sampling_seed


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
                 with_rows: bool = False) -> None:  # fmt: skip
        self.prompts, self.launch, self.score, self.share = prompts, launch, score, share
        self.with_rows = with_rows
        """Multi-turn episodes (``env.name``): each step's data rows go with its prompts."""
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
        return head.prompts, samples

    def take_scores(self) -> Any:
        """The rewards ``score`` gave the batch ``take`` returned last (waits for them)."""
        assert self._taken is not None, "take_scores before take"
        return self.share(self._taken.scores.result)

    def data_state(self) -> dict:
        """The data position after the consumed steps (what a checkpoint must save)."""
        if self._buffer:
            return self._buffer[0].data_state_before
        return self.prompts.state_dict()

    def load_data_state(self, state: dict) -> None:
        """Continue the data stream from ``state`` (a checkpoint's ``data_state``, what
        ``data_state`` returned when it was saved); before the first ``take``."""
        if self._buffer or self._taken is not None:
            raise RuntimeError(
                "load_data_state after take: the buffer already holds batches "
                "drawn from the old position."
            )
        self.prompts.load_state_dict(state)

    def _fill(self, step: int) -> None:
        if self.window_end is None:
            steps = window_steps(step, self.ahead, self.sync_interval, self.total_steps)
        else:
            steps = steps_through(step, self.ahead, self.window_end(step), self.total_steps)
        drawn = []
        for s in steps:  # data stream in step order, as the serial loop draws it
            before = self.prompts.state_dict()
            drawn.append((s, self.prompts.next_batch(self.prompts_per_step), before))
        thunks = self.launch([self._step_prompts(s, ps) for s, ps, _ in drawn])
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

    def _step_prompts(self, step: int, prompts: list) -> tuple:
        """What ``launch`` takes of one step: ``(prompt_ids, seed[, rows])``."""
        ids, seed = [p.prompt_ids for p in prompts], sampling_seed(self.rollout_seed, step)
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
