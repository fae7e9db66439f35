"""The run directory before a run starts: usable, and never silently replaced.

A run directory that already holds a run (its config.yaml, metrics.jsonl, checkpoints, ...)
is refused unless the new run continues it (``--resume``) or replaces it (``--overwrite``,
which clears it first). Without the refusal a second run into the same directory drops the
first run's metrics lines, rewrites its summary, and leaves its later checkpoints beside the
new ones, where a later ``--resume`` would pick them up.

Every rank checks for itself (``check_run_dir`` only reads) and global rank 0 alone clears
(``clear_run_dir``), once every other check of the run has passed too. Under torchrun each
rank is its own process, so a check that rank 0 alone made would leave the other ranks to
find a bad directory by crashing on it. The ranks reach the same verdict whichever looks
first: what a start writes before the process groups are up (the directory itself,
train.log, hf_model/) turns no verdict, and what a refusal is about (a run's config.yaml,
metrics.jsonl, checkpoints, ...) is written only after them, which no rank joins before its
own check. The directory is on a filesystem every rank sees (docs/install.md).

``--resume auto`` (``plan_start``) decides by itself, so that the same command line serves
every launch, torchrun's restarts of its workers included: it resumes from the newest
complete checkpoint when there is one, and otherwise starts afresh over what a run that
died before its first checkpoint left. A finished run (its summary.json) is refused as
without ``--resume``: nothing is left to resume, and a restart must not redo it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megatron_grpo.checkpoint import list_checkpoints
from megatron_grpo.config.schema import ConfigError
from megatron_grpo.metrics.summary import SUMMARY_FILE
from megatron_grpo.trainer.restarts import RESTARTS_FILE

# Left by a start that failed before training, and reused only when still valid:
# the prepared model (models/prepare.py checks its recipe) and the log file; and the
# failures of in-job restarts, which a restart starting afresh must still read
# (trainer/restarts.py: each record names its job).
_NOT_A_RUN = {"hf_model", "train.log", RESTARTS_FILE}


def run_contents(run_dir: Path) -> list[str]:
    """Names in ``run_dir`` that belong to a run (sorted); [] for a fresh directory."""
    if not run_dir.is_dir():
        return []
    return sorted(p.name for p in run_dir.iterdir() if p.name not in _NOT_A_RUN)


def check_run_dir(run_dir: str | os.PathLike[str], *, resume: bool, overwrite: bool) -> list[Path]:
    """Refuse a run directory this run cannot or must not use; return what ``overwrite``
    deletes ([] without it). Reads only: every rank calls it.

    Raises ConfigError (one line naming the directory and the fix) when the path is a file,
    is not writable, or holds a run and neither ``resume`` nor ``overwrite`` is given.
    """
    run_dir = Path(run_dir)
    if resume and overwrite:
        raise ConfigError(
            "--resume and --overwrite contradict each other: --resume continues the run in "
            f"{run_dir}, --overwrite deletes it; pass one."
        )
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(
            f"run_dir={str(run_dir)!r} is a file, not a directory: pass --run-dir a directory "
            "path (it is created when missing)."
        )
    existing = next((p for p in [run_dir, *run_dir.parents] if p.exists()), Path("."))
    if not os.access(existing, os.W_OK | os.X_OK):  # False on a read-only mount, even for root
        raise ConfigError(
            f"run_dir={str(run_dir)!r} is not writable (no write access to {existing}): pass "
            "--run-dir a directory you can write to."
        )
    if resume:
        if not list_checkpoints(run_dir):
            raise ConfigError(
                f"--resume: no complete checkpoint under {run_dir / 'checkpoints'}; start "
                "without --resume, or point --run-dir at the run to continue."
            )
        return []
    found = run_contents(run_dir)
    if found and not overwrite:
        shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
        raise ConfigError(
            f"run_dir={str(run_dir)!r} already holds a run ({shown}): continue it with "
            "--resume, replace it with --overwrite, or pass another --run-dir."
        )
    return [run_dir / name for name in found]


@dataclass(frozen=True)
class Start:
    """How a run starts in its run directory: resumed or fresh, and what rank 0 deletes first."""

    resume: bool
    stale: list[Path]


def plan_start(
    run_dir: str | os.PathLike[str], *, resume: bool | Literal["auto"], overwrite: bool
) -> Start:
    """``check_run_dir`` for ``--resume`` (True), none (False) or ``--resume auto``: resume
    when the run directory holds a complete checkpoint, else start afresh over an unfinished
    run (deleting it, as ``--overwrite`` does). Reads only: every rank calls it.

    Raises ConfigError, as ``check_run_dir`` does, and for ``auto`` on a finished run."""
    run_dir = Path(run_dir)
    if resume != "auto":
        return Start(bool(resume), check_run_dir(run_dir, resume=bool(resume), overwrite=overwrite))
    if overwrite:
        raise ConfigError(
            "--resume auto and --overwrite contradict each other: --resume auto continues the "
            f"run in {run_dir}, --overwrite deletes it; pass one."
        )
    if (run_dir / SUMMARY_FILE).is_file():
        raise ConfigError(
            f"run_dir={str(run_dir)!r} holds a finished run ({SUMMARY_FILE}): nothing to "
            "resume; replace it with --overwrite, or pass another --run-dir."
        )
    if list_checkpoints(run_dir):
        return Start(True, check_run_dir(run_dir, resume=True, overwrite=False))
    return Start(False, check_run_dir(run_dir, resume=False, overwrite=True))


def clear_run_dir(paths: list[Path]) -> None:
    """Delete ``paths`` (``check_run_dir``'s answer): one process only, after every check."""
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
