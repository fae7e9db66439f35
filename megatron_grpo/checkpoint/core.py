"""Checkpoint and resume of the whole training loop.

Design: docs/checkpointing.md, "The checkpoint format (checkpoint/core.py)".
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_grpo.checkpoint.rng import get_rng_state, set_rng_state
from megatron_grpo.checkpoint.store import (
    LATEST_FILE,
    RNG_DIR,
    STATE_FILE,
    TMP_SUFFIX,
    CheckpointError,
    checkpoints_root,
    gather_files,
    list_checkpoints,
    rank_world,
    resolve_checkpoint,
    step_dir_name,
    verify_checkpoint,
)
from megatron_grpo.platform.lifetime import start_checkpoint_manager

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_RESERVED = {RNG_DIR}

StateDictSource = Mapping[str, Any] | Callable[[], Mapping[str, Any]]
"""A (sharded) state dict, or a function returning one (built only when needed)."""


@dataclass
class LoopState:
    """Where the training loop stands; everything here must be JSON-able."""

    step: int
    """The last finished trainer step; a resumed run continues at step + 1."""
    data_state: dict[str, Any] = field(default_factory=dict)
    """The data source's ``state_dict()`` (its position in the prompt stream)."""
    policy_version: int = 0
    """The trainer step whose weights vLLM serves now (the last sync)."""
    sync_phase: int = 0
    """Steps since the last weight push (step - policy_version with Algorithm 1's schedule);
    kept explicitly so a resumed run pushes on the same steps as an uninterrupted one."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else the trainer wants back (reference-reset counters, NaN-streak, layout)."""

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"LoopState.step={self.step} must be >= 0.")
        try:
            json.dumps(asdict(self), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"LoopState is not JSON-able ({e}): keep data_state and extra to numbers, "
                "strings, bools, None and lists/dicts of them (finite floats only)."
            ) from e


@dataclass
class LoadedCheckpoint:
    path: Path
    """The step directory that was loaded."""
    loop_state: LoopState
    state_dicts: dict[str, dict[str, Any]]
    """Name -> the loaded state dict (same nesting as its template), for each name asked."""
    rng_restored: bool
    """False when RNG states were not restored (restore_rng=False, or a different world size)."""
    saved_world_size: int


# -- distributed helpers ---------------------------------------------------------------------
def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _resolve(source: StateDictSource) -> Mapping[str, Any]:
    return source() if callable(source) else source


def _check_names(names: Iterable[str]) -> None:
    for name in names:
        if not _NAME_RE.match(name) or name in _RESERVED:
            raise CheckpointError(
                f"state dict name {name!r} is not usable as a checkpoint sub-directory: use "
                f"letters, digits and '_' (starting with a letter), not one of {sorted(_RESERVED)}."
            )


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- save ------------------------------------------------------------------------------------
def _commit(tmp: Path, final: Path, root: Path) -> None:
    """Rank 0: make the finished ``tmp`` the checkpoint ``final`` and point ``latest`` at it.

    Until the rename, ``latest`` and every older checkpoint are untouched. Re-saving a step
    that exists (a resumed run passing an old step again) moves the old one aside first.
    """
    replaced = None
    if final.exists():
        replaced = final.with_name(final.name + ".replaced" + TMP_SUFFIX)
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(tmp, final)
    _fsync_dir(root)
    _write_text_atomic(root / LATEST_FILE, final.name + "\n")
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def _prune(root: Path, keep_last: int, newest: int) -> list[Path]:
    """Delete complete checkpoints older than ``newest`` beyond the ``keep_last`` most recent.

    Checkpoints with a larger step than ``newest`` belong to a timeline a resumed run left
    behind; they are not counted or deleted here (a later save of that step replaces them).
    """
    older = [(s, p) for s, p in list_checkpoints(root.parent) if s < newest]
    doomed = [p for _, p in older[: max(len(older) - (keep_last - 1), 0)]]
    for p in doomed:
        shutil.rmtree(p)
    return doomed


def _make_tmp(root: Path, tmp: Path, subs: list[str]) -> None:
    """Rank 0: an empty ``tmp`` with ``subs``, after removing the leftovers of a save that
    crashed (this step or any other; they are never read)."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("*" + TMP_SUFFIX):
        if stale.is_dir():
            shutil.rmtree(stale)
        else:
            stale.unlink()
    for sub in subs:
        (tmp / sub).mkdir(parents=True)


def _write_state(tmp: Path, meta: dict[str, Any]) -> None:
    """state.json is written last: its presence marks the directory as complete."""
    with open(tmp / STATE_FILE, "w") as f:
        json.dump(meta, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _check_save_args(state_dicts: Mapping[str, Any], keep_last: int | None) -> None:
    _check_names(state_dicts)
    if state_dicts and not (dist.is_available() and dist.is_initialized()):
        raise CheckpointError(
            f"saving sharded state dicts {sorted(state_dicts)} needs torch.distributed "
            "(dist_checkpointing.save is collective): call init_distributed() first, even "
            "for one process."
        )
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1 (or None to keep all).")


def _seal(tmp: Path, final: Path, meta: dict[str, Any], keep_last: int | None) -> None:
    """Rank 0: write state.json, rename ``tmp`` to ``final``, prune to ``keep_last``."""
    _write_state(tmp, meta)
    _commit(tmp, final, final.parent)
    if keep_last is not None:
        for p in _prune(final.parent, keep_last, meta["step"]):
            log.info("pruned checkpoint %s (keep_last=%d)", p, keep_last)


def save_checkpoint(
    run_dir: str | os.PathLike,
    loop_state: LoopState,
    state_dicts: Mapping[str, StateDictSource] | None = None,
    *,
    keep_last: int | None = None,
    save_rng: bool = True,
) -> Path:
    """Save the loop at ``loop_state.step``; collective over all ranks. Returns the step dir.

    Args:
        run_dir: the run directory; checkpoints go to ``run_dir/checkpoints/step_NNNNNN``.
        loop_state: step, data position, policy version, sync phase, extras (rank 0's copy
            is written; the trainer keeps it identical on every rank).
        state_dicts: name -> sharded state dict (or a function returning one), each saved
            with ``megatron.core.dist_checkpointing.save`` into its own sub-directory, e.g.
            ``{"model": {"model": m_ssd, "optimizer": opt_ssd}, "ref": ref_ssd}``.
        keep_last: keep this many most recent checkpoints (None keeps all).
        save_rng: write this rank's RNG states to ``rng/rank_NNNNN.pt``.
    """
    rank, world = rank_world()
    state_dicts = dict(state_dicts or {})
    _check_save_args(state_dicts, keep_last)
    step = loop_state.step
    root = checkpoints_root(run_dir)
    final = root / step_dir_name(step)
    tmp = final.with_name(final.name + TMP_SUFFIX)

    if rank == 0:
        _make_tmp(root, tmp, [*state_dicts, RNG_DIR])
    _barrier()

    if state_dicts:
        from megatron.core import dist_checkpointing

        start_checkpoint_manager()  # dies with this rank, survives group-wide pre-emption signals
        for name, source in state_dicts.items():
            dist_checkpointing.save(dict(_resolve(source)), str(tmp / name))

    if save_rng:
        torch.save(get_rng_state(), tmp / RNG_DIR / f"rank_{rank:05d}.pt")
    _barrier()  # every rank's files are in tmp before rank 0 seals it
    files = gather_files(tmp, rank, world)

    if rank == 0:
        meta = {
            "format_version": FORMAT_VERSION, "step": step, "world_size": world,
            "state_dicts": sorted(state_dicts), "rng": save_rng,
            "loop_state": asdict(loop_state), "files": files,
        }  # fmt: skip
        _seal(tmp, final, meta, keep_last)
    _barrier()  # no rank returns (and, say, exits) before the checkpoint is committed
    return final


# -- load ------------------------------------------------------------------------------------
def read_state(path: str | os.PathLike) -> dict[str, Any]:
    """The raw state.json of a checkpoint (run dir, checkpoints dir or step dir)."""
    path = resolve_checkpoint(path)
    try:
        meta = json.loads((path / STATE_FILE).read_text())
    except ValueError as e:
        raise CheckpointError(
            f"{path / STATE_FILE} is damaged ({e}): load an older checkpoint, or delete this one."
        ) from e
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path / STATE_FILE} has format_version={meta.get('format_version')!r}; this code "
            f"reads {FORMAT_VERSION}: load it with the megatron-grpo version that wrote it."
        )
    return meta


def _load_sharded(
    step_dir: Path, wanted: Mapping[str, StateDictSource], strict: Any
) -> dict[str, dict[str, Any]]:
    """``dist_checkpointing.load`` of each wanted part into its template; collective."""
    loaded: dict[str, dict[str, Any]] = {}
    if wanted:
        if not (dist.is_available() and dist.is_initialized()):
            raise CheckpointError(
                f"loading sharded state dicts {list(wanted)} needs torch.distributed "
                "(dist_checkpointing.load is collective): call init_distributed() first."
            )
        from megatron.core import dist_checkpointing

        kwargs = {} if strict is None else {"strict": strict}
        for name, template in wanted.items():
            loaded[name] = dist_checkpointing.load(
                dict(_resolve(template)), str(step_dir / name), **kwargs
            )
    return loaded


def _restore_rng(step_dir: Path, meta: dict[str, Any], rank: int, world: int) -> bool:
    """Set this rank's RNG states from the checkpoint when it saved them and the world size
    matches (else a warning); whether they were restored."""
    if not meta.get("rng"):
        return False
    rng_file = step_dir / RNG_DIR / f"rank_{rank:05d}.pt"
    if meta["world_size"] != world:
        log.warning(
            "checkpoint %s was saved by %d ranks, this run has %d: RNG states are not "
            "restored (random draws will differ from an uninterrupted run)",
            step_dir,
            meta["world_size"],
            world,
        )
        return False
    if not rng_file.is_file():
        raise CheckpointError(f"{rng_file} is missing: the checkpoint is damaged.")
    set_rng_state(torch.load(rng_file, weights_only=True, map_location="cpu"))
    return True


def load_checkpoint(
    path: str | os.PathLike,
    templates: Mapping[str, StateDictSource] | None = None,
    *,
    optional: Iterable[str] = (),
    restore_rng: bool = True,
    strict: Any = None,
    verify: bool = True,
) -> LoadedCheckpoint:
    """Load a checkpoint; collective over all ranks when ``templates`` is not empty.

    Args:
        path: a run directory (loads its latest checkpoint), its checkpoints/ folder, or a
            step directory.
        templates: name -> this rank's sharded state dict (or a function returning one) for
            each part to load. Their ShardedTensors say which slice of each global tensor
            this rank wants, so any TP/PP/DP layout can load any saved one.
        optional: names that may be absent from the checkpoint (e.g. ``"ref"``); they are
            then left out of the result instead of raising.
        restore_rng: set this rank's RNG states from the checkpoint. Restored only when the
            world size matches the saving run's (else a warning, and ``rng_restored=False``).
        strict: passed to ``dist_checkpointing.load`` (None keeps its default).
        verify: check every file's size and checksum against the record made at save first
            (``verify_checkpoint``: CheckpointError naming the damaged file).
    """
    step_dir = resolve_checkpoint(path)
    meta = read_state(step_dir)
    rank, world = rank_world()
    if verify:
        verify_checkpoint(step_dir)
    templates = dict(templates or {})
    _check_names(templates)
    optional = set(optional)

    missing = [n for n in templates if not (step_dir / n).is_dir()]
    required_missing = [n for n in missing if n not in optional]
    if required_missing:
        raise CheckpointError(
            f"{step_dir} has no {required_missing} (it holds {meta['state_dicts']}): load only "
            "those, or pass the name in optional=."
        )
    wanted = {n: templates[n] for n in templates if n not in missing}
    loaded = _load_sharded(step_dir, wanted, strict)
    rng_restored = restore_rng and _restore_rng(step_dir, meta, rank, world)
    return LoadedCheckpoint(
        path=step_dir,
        loop_state=LoopState(**meta["loop_state"]),
        state_dicts=loaded,
        rng_restored=rng_restored,
        saved_world_size=meta["world_size"],
    )
