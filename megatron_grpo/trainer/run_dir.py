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

A run that resumes needs nothing but its directory (``run_config``): without ``--config``
the run's own config.yaml is the config (overrides on top), never the built-in default,
and a ``--config`` that contradicts what the checkpoint holds (another model shape, the
other optimizer kind) is refused in one line before anything starts. ``--resume`` on a
finished run (its last checkpoint or its summary at ``steps``) is refused too: nothing is
left to train unless ``--steps`` goes further.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megatron_grpo.checkpoint import list_checkpoints
from megatron_grpo.config import Config, load_config
from megatron_grpo.config.loader import parse_overrides
from megatron_grpo.config.schema import ConfigError
from megatron_grpo.distributed.setup import rank_device
from megatron_grpo.metrics.summary import SUMMARY_FILE
from megatron_grpo.models.shapes import resolve_spec
from megatron_grpo.models.spec import ModelSpec
from megatron_grpo.policy.optimizer import use_distributed_optimizer
from megatron_grpo.trainer.restarts import RESTARTS_FILE

# Left by a start that failed before training, and reused only when still valid:
# the prepared model (models/prepare.py checks its recipe) and the log file; and the
# failures of in-job restarts, which a restart starting afresh must still read
# (trainer/restarts.py: each record names its job).
_NOT_A_RUN = {"hf_model", "train.log", RESTARTS_FILE}
CONFIG_FILE = "config.yaml"
"""The run's resolved config, written by rank 0 once the run starts (``save_config``)."""
# The ModelSpec fields that shape a checkpoint's tensors: a resume must keep them all.
_SHAPE = ("num_experts", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
          "ffn_hidden_size", "moe_ffn_hidden_size", "shared_expert_ffn_hidden_size",
          "vocab_size", "tie_word_embeddings", "qkv_bias", "qk_norm")  # fmt: skip


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
    run_dir: str | os.PathLike[str],
    *,
    resume: bool | Literal["auto"],
    overwrite: bool,
    steps: int | None = None,
) -> Start:
    """``check_run_dir`` for ``--resume`` (True), none (False) or ``--resume auto``: resume
    when the run directory holds a complete checkpoint, else start afresh over an unfinished
    run (deleting it, as ``--overwrite`` does). Reads only: every rank calls it.

    Raises ConfigError, as ``check_run_dir`` does, for ``auto`` on a finished run, and for
    ``--resume`` on a run finished at ``steps`` (this run's; None: not checked)."""
    run_dir = Path(run_dir)
    if resume != "auto":
        stale = check_run_dir(run_dir, resume=bool(resume), overwrite=overwrite)
        if resume and steps is not None:
            _refuse_finished(run_dir, steps)
        return Start(bool(resume), stale)
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


def _refuse_finished(run_dir: Path, steps: int) -> None:
    """``--resume`` on a run that already trained ``steps`` steps: one line, nothing started
    (the resume would start the engines only to find no step left, and reprint the old
    summary as if it had run)."""
    last = list_checkpoints(run_dir)[-1][0]
    summary = run_dir / SUMMARY_FILE
    if summary.is_file():
        try:
            last = max(last, int(json.loads(summary.read_text())["last_step"]))
        except (ValueError, KeyError, TypeError):
            last = max(last, steps)  # a summary without its last step: finished all the same
    if last >= steps:
        raise ConfigError(
            f"run_dir={str(run_dir)!r} holds a finished run (trained to step {last}, steps="
            f"{steps}): nothing to resume; to train it further pass --resume --steps N with N > "
            f"{last}, or start afresh with --overwrite."
        )


def run_config(
    config: str | None, overrides: list[str], resume: bool | Literal["auto"]
) -> tuple[Config, str | None]:
    """The config of ``train`` and the config file its ranks load (None: the built-in default).

    A start that resumes a checkpoint (``--resume``, or ``--resume auto`` with one) reads the
    run's own ``config.yaml`` when no ``config`` is given, ``overrides`` on top; with a
    ``config``, that config must describe what the checkpoint holds (``check_resumable``).
    Raises ConfigError, one line, when neither can be had."""
    if not resume:
        return load_config(config, overrides), config
    if config is not None:
        cfg = load_config(config, overrides)
        saved = Path(cfg.run_dir) / CONFIG_FILE
        if _resumes(Path(cfg.run_dir), resume) and saved.is_file():
            check_resumable(cfg, _load_saved(saved), config)
        return cfg, config
    run_dir = Path(str(parse_overrides(overrides).get("run_dir", Config.run_dir)))
    saved = run_dir / CONFIG_FILE
    if not _resumes(run_dir, resume):
        return load_config(None, overrides), None
    if not saved.is_file():
        raise ConfigError(
            f"--resume without --config: {saved} is missing, so the run's config is unknown; "
            "pass the run's --config."
        )
    _load_saved(saved)  # its own errors first, named as the run's file
    return load_config(saved, [*overrides, f"run_dir={run_dir}"]), str(saved)


def _resumes(run_dir: Path, resume: bool | Literal["auto"]) -> bool:
    """Whether this start continues a checkpoint (without one ``--resume`` is refused later,
    ``--resume auto`` starts afresh)."""
    return bool(resume) and bool(list_checkpoints(run_dir))


def _load_saved(path: Path) -> Config:
    try:
        return load_config(path)
    except ConfigError as e:
        raise ConfigError(
            f"the run's {path} does not load ({e}): pass the run's --config."
        ) from None


def check_resumable(cfg: Config, saved: Config, config: str) -> None:
    """ConfigError (one line) when ``cfg`` (from ``config``) cannot load the checkpoint that
    ``saved`` (the run's config.yaml) wrote: another model shape, or the other optimizer kind
    (plain and distributed state differ: docs/checkpointing.md). Any parallel layout loads."""
    fix = "resume without --config (the run's config.yaml is the default), or start afresh"
    here, there = _spec(cfg), _spec(saved)
    if here is not None and there is not None:
        for key in _SHAPE:
            a, b = getattr(here, key), getattr(there, key)
            if a != b:
                raise ConfigError(
                    f"--config {config} trains model.hf_path={cfg.model.hf_path} ({key}={a}), "
                    f"but the checkpoint in {cfg.run_dir} holds model.hf_path="
                    f"{saved.model.hf_path} ({key}={b}): {fix} with --overwrite."
                )
    device = rank_device(cfg.parallel)
    ours, theirs = (use_distributed_optimizer(c.optim, device) for c in (cfg, saved))
    if ours != theirs:
        kind = {True: "distributed", False: "plain"}
        raise ConfigError(
            f"--config {config}: optim.distributed_optimizer={cfg.optim.distributed_optimizer} "
            f"is megatron's {kind[ours]} optimizer, the checkpoint in {cfg.run_dir} holds the "
            f"{kind[theirs]} one's state: set optim.distributed_optimizer="
            f"{saved.optim.distributed_optimizer}, or {fix}."
        )


def _spec(cfg: Config) -> ModelSpec | None:
    """The model's shape; None when it cannot be read here (a path not on this machine)."""
    try:
        return resolve_spec(cfg.model.hf_path)[0]
    except ConfigError:
        return None


def clear_run_dir(paths: list[Path]) -> None:
    """Delete ``paths`` (``check_run_dir``'s answer): one process only, after every check."""
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
