"""The schedule model of one sync window under ``rollout.ahead`` (rollout/ahead.py): when the
engines generate and the trainer trains, step by step, for any ahead and placement. Pure
Python; ``bench project`` (bench/projection/model.py), ``bench throughput``'s prediction and the
report's timeline use it (docs/benchmarks.md §5).

What generating a window's batches ahead buys. With R the
seconds to generate (and score) one step's batch, T the trainer's seconds per step
(log-probs + SGD), S the seconds per sync, a window of v steps takes:
  serial                     v * (R + T) + S
  disaggregated, ahead >= v-1  R + v*T + S            when R <= T (the trainer is the pace)
                             v*R + T + S              when R > T  (the engines are)
  colocated, ahead >= v-1    R_batch(v) + v*T + S     (one call; no overlap on one device)
where R_batch(m) = R * (f + (1 - f) * m) models how a generate call of m steps' prompts
costs against one of a single step (f: the share of R that does not grow with the batch;
f = 0 on a saturated CPU, near 1 on a GPU far from saturation). ``window_time`` simulates
the schedule the code runs for any ahead (chunks of ahead+1 steps, each chunk launched when
the trainer asks for its first step), of which the lines above are the limits.
"""

from __future__ import annotations


def window_events(r: float, t: float, s: float, sync_interval: int, ahead: int, placement: str,
                  batch_fixed: float = 0.0) -> list[tuple[str, str, float, float]]:  # fmt: skip
    """The schedule of one sync window of ``sync_interval`` steps (the last one syncs) under
    rollout.ahead, as ``(lane, label, start_s, end_s)`` with lanes ``vllm`` and ``trainer``.

    ``r``: seconds to generate one step's batch, ``t``: trainer seconds per step, ``s``:
    seconds per sync, ``placement``: ``colocated`` or ``disaggregated``, ``batch_fixed``:
    the share f of ``r`` that a larger colocated call does not repeat (see above)."""
    if sync_interval < 1 or ahead < 0 or min(r, t, s) < 0 or not 0 <= batch_fixed <= 1:
        raise ValueError(
            f"window_time(r={r}, t={t}, s={s}, v={sync_interval}, ahead={ahead}, batch_fixed="
            f"{batch_fixed}): need v >= 1, ahead >= 0, times >= 0 and 0 <= batch_fixed <= 1."
        )
    if placement not in ("colocated", "disaggregated"):
        raise ValueError(f"placement={placement!r}: 'colocated' or 'disaggregated'.")
    events, trainer = [], 0.0
    for first in range(0, sync_interval, ahead + 1):
        m = min(ahead + 1, sync_interval - first)
        if placement == "colocated":  # one call, then the trainer; nothing overlaps
            gen = r * (batch_fixed + (1 - batch_fixed) * m) if m > 1 else r
            steps = f"{first + 1}-{first + m}" if m > 1 else f"{first + 1}"
            events.append(("vllm", f"gen {steps}", trainer, trainer + gen))
            trainer += gen
            for j in range(m):
                events.append(("trainer", f"train {first + j + 1}", trainer, trainer + t))
                trainer += t
        else:  # queued back to back when the trainer asks for the chunk's first step
            launched = trainer
            for j in range(m):
                ready = launched + (j + 1) * r
                events.append(("vllm", f"gen {first + j + 1}", ready - r, ready))
                start = max(ready, trainer)
                events.append(("trainer", f"train {first + j + 1}", start, start + t))
                trainer = start + t
    events.append(("trainer", "sync", trainer, trainer + s))
    events.append(("vllm", "sync", trainer, trainer + s))
    return events


def window_time(r: float, t: float, s: float, sync_interval: int, ahead: int, placement: str,
                batch_fixed: float = 0.0) -> float:  # fmt: skip
    """Seconds for one sync window (``window_events``' end)."""
    return max(e[3] for e in window_events(r, t, s, sync_interval, ahead, placement, batch_fixed))


def schedule_step_time(r: float, t: float, s: float, sync_interval: int, ahead: int, placement: str,
                       batch_fixed: float = 0.0) -> float:  # fmt: skip
    """Mean seconds per trainer step: ``window_time / v``."""
    return window_time(r, t, s, sync_interval, ahead, placement, batch_fixed) / sync_interval
