"""The run directory before a run starts: usable, and never silently replaced.

A run directory that already holds a run (its config.yaml, metrics.jsonl, checkpoints, ...)
is refused unless the new run continues it (``--resume``) or replaces it (``--overwrite``,
which clears it first). Without the refusal a second run into the same directory drops the
first run's metrics lines, rewrites its summary, and leaves its later checkpoints beside the
new ones, where a later ``--resume`` would pick them up.

Checked by global rank 0 only (the other ranks of a torchrun see the same shared directory,
and rank 0 may already be writing into it when they look), before any model is built.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from megatron_grpo.checkpoint import list_checkpoints
from megatron_grpo.config.schema import ConfigError

# Left by a start that failed before training, and reused only when still valid:
# the prepared model (models/prepare.py checks its recipe) and the log file.
_NOT_A_RUN = {"hf_model", "train.log"}


def run_contents(run_dir: Path) -> list[str]:
    """Names in ``run_dir`` that belong to a run (sorted); [] for a fresh directory."""
    if not run_dir.is_dir():
        return []
    return sorted(p.name for p in run_dir.iterdir() if p.name not in _NOT_A_RUN)


def prepare_run_dir(run_dir: str | os.PathLike, *, resume: bool, overwrite: bool) -> None:
    """Refuse a run directory this run cannot or must not use; clear it for ``overwrite``.

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
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"run_dir={str(run_dir)!r} is not writable ({existing} denies this user): pass "
            "--run-dir a directory you can write to."
        )
    if resume:
        if not list_checkpoints(run_dir):
            raise ConfigError(
                f"--resume: no complete checkpoint under {run_dir / 'checkpoints'}; start "
                "without --resume, or point --run-dir at the run to continue."
            )
        return
    found = run_contents(run_dir)
    if not found:
        return
    if not overwrite:
        shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
        raise ConfigError(
            f"run_dir={str(run_dir)!r} already holds a run ({shown}): continue it with "
            "--resume, replace it with --overwrite, or pass another --run-dir."
        )
    for name in found:
        p = run_dir / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
