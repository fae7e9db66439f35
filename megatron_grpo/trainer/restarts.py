"""In-job restarts under ``torchrun --max-restarts`` (docs/launch.md, "Restarts").

A rank whose loop fails appends the step and the cause to ``RUN_DIR/restarts.jsonl``; the
restarted attempt (``train --resume auto``) says which step failed and which steps it redoes,
and when the last restart torchrun allows fails too, the first rank to record that failure
prints one line naming the step and the cause (torchrun then stops the job). Records carry
torchrun's run id, so a later job in the same run directory reads only its own.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_grpo.distributed.setup import (
    node_restart_count,
    restart_attempt,
    restarts_enabled,
)
from megatron_grpo.metrics.console import console_err

RESTARTS_FILE = "restarts.jsonl"


@dataclass(frozen=True)
class Attempt:
    """This worker's attempt, from torchrun's environment (torch/distributed/elastic)."""

    number: int  # job-wide, agreed through the store (distributed/setup.py restart_attempt)
    max_restarts: int  # TORCHELASTIC_MAX_RESTARTS (torchrun --max-restarts)
    run_id: str  # TORCHELASTIC_RUN_ID: one per torchrun job, the same across its restarts
    node_restarts: int | None = None
    """This node's agent's count (TORCHELASTIC_RESTART_COUNT), when it differs from
    ``number``: across nodes only the agent of a failing node counts a restart, and it is
    that agent which stops the job when it has none left."""

    @classmethod
    def current(cls) -> Attempt | None:
        """None outside torchrun and under ``--max-restarts 0`` (nothing restarts)."""
        env = os.environ
        if not restarts_enabled():
            return None
        number, node = restart_attempt(), node_restart_count()
        return cls(number, int(env["TORCHELASTIC_MAX_RESTARTS"]),
                   env.get("TORCHELASTIC_RUN_ID", ""), None if node == number else node)  # fmt: skip

    @property
    def last(self) -> bool:
        """This node's torchrun has no restart left after this attempt: a failure here stops
        the job."""
        count = self.number if self.node_restarts is None else self.node_restarts
        return count >= self.max_restarts


def failures(run_dir: str | os.PathLike[str], attempt: Attempt) -> list[dict[str, Any]]:
    """This job's failure records (every attempt's, every rank's), in the order written."""
    path = Path(run_dir) / RESTARTS_FILE
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a record torn by a kill mid-write
        if row.get("run_id") == attempt.run_id:
            out.append(row)
    return out


def record_failure(
    run_dir: str | os.PathLike[str], attempt: Attempt, rank: int, step: int, error: BaseException
) -> str | None:
    """Append this rank's failure at ``step``; returns the give-up line when this is the last
    attempt and this rank's record is the attempt's first (its cause, not a peer's echo)."""
    cause = f"{type(error).__name__}: {error}".splitlines()[0][:300]
    row = {"run_id": attempt.run_id, "attempt": attempt.number, "rank": rank, "step": step,
           "cause": cause}  # fmt: skip
    path = Path(run_dir) / RESTARTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    # One write of one line with O_APPEND: records of several ranks do not interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(row) + "\n").encode())
    finally:
        os.close(fd)
    if not attempt.last:
        return None
    rows = failures(run_dir, attempt)
    first = next(r for r in rows if r["attempt"] == attempt.number)
    if (first["rank"], first["step"], first["cause"]) != (rank, step, cause):
        return None
    return give_up_line(rows, attempt)


def note_failure(
    run_dir: str | os.PathLike[str], rank: int, step: int, error: BaseException
) -> None:
    """Under torchrun --max-restarts: record this rank's failure at ``step`` for the restarted
    attempt, and print the one line when no restart is left (nothing outside torchrun)."""
    attempt = Attempt.current()
    if attempt is None:
        return
    line = record_failure(run_dir, attempt, rank, step, error)
    if line is not None:
        print(line, file=console_err(), flush=True)


def give_up_line(rows: list[dict[str, Any]], attempt: Attempt) -> str:
    """The one line of a restart loop: the step each attempt failed at, the last cause."""
    firsts: dict[int, dict[str, Any]] = {}
    for r in rows:
        firsts.setdefault(r["attempt"], r)
    last = firsts[attempt.number]
    steps = [str(firsts[a]["step"]) if a in firsts else "?" for a in range(attempt.number + 1)]
    if len(set(steps)) == 1:
        where = f"step {last['step']} failed on each of the"
    else:
        where = "steps " + ", ".join(steps) + " failed on the"
    return (
        f"error: restart loop: {where} {attempt.number + 1} attempts (MAX_RESTARTS="
        f"{attempt.max_restarts}), last with {last['cause']}: stopping; fix the cause, then "
        "launch again (--resume auto continues from the latest checkpoint)."
    )


def restart_line(run_dir: str | os.PathLike[str], attempt: Attempt, resumed_step: int) -> str:
    """What a restarted attempt says once it has resumed: which failure it follows, and the
    steps it redoes (those after its checkpoint)."""
    before = [r for r in failures(run_dir, attempt) if r["attempt"] == attempt.number - 1]
    failed = f"failed at step {before[0]['step']} ({before[0]['cause']})" if before else "failed"
    redone = before[0]["step"] - 1 - resumed_step if before else None
    lost = f"; {redone} finished step(s) redone" if redone is not None else ""
    return (
        f"restart {attempt.number} of {attempt.max_restarts}: the previous attempt {failed}; "
        f"continuing from step {resumed_step}{lost}"
    )
