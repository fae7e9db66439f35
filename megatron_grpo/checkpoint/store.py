"""The checkpoint directory of a run: its names, which checkpoints are complete, which one to
resume from, and their integrity (every file's size and CRC32 recorded in state.json).

Written by ``checkpoint.core.save_checkpoint``; the layout is in
docs/checkpointing.md.
"""

from __future__ import annotations

import json
import logging
import os
import re
import zlib
from pathlib import Path

import torch.distributed as dist

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
STATE_FILE = "state.json"
RNG_DIR = "rng"
TMP_SUFFIX = ".tmp"
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match what is asked of it."""


# -- paths -----------------------------------------------------------------------------------
def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def checkpoints_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def is_complete(path: str | os.PathLike) -> bool:
    """A finished checkpoint: a ``step_N`` directory (not ``.tmp``) holding state.json."""
    path = Path(path)
    return bool(_STEP_RE.match(path.name)) and (path / STATE_FILE).is_file()


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run as (step, path), oldest first; ``.tmp`` dirs ignored."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def find_latest(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint to resume from, or None when the run has none.

    The ``latest`` pointer when it names a complete checkpoint; otherwise (pointer missing or
    stale) the complete checkpoint with the highest step. ``.tmp`` directories are ignored.
    """
    root = checkpoints_root(run_dir)
    pointer = root / LATEST_FILE
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if is_complete(target):
            return target
        log.warning(
            "%s names %s, which is not a complete checkpoint; scanning instead", pointer, target
        )
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A step directory from a step directory, a run directory or its checkpoints/ folder."""
    path = Path(path)
    if is_complete(path):
        return path
    if path.name.endswith(TMP_SUFFIX):
        raise CheckpointError(f"{path} is an unfinished checkpoint (.tmp): load a complete one.")
    run_dir = path.parent if path.name == CHECKPOINTS_DIR else path
    latest = find_latest(run_dir)
    if latest is None:
        raise CheckpointError(
            f"no complete checkpoint under {path} (looked for {checkpoints_root(run_dir)}/"
            f"step_NNNNNN/{STATE_FILE}): pass a run directory that has one, or start fresh."
        )
    return latest


# -- distributed helpers ---------------------------------------------------------------------
def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# -- integrity -------------------------------------------------------------------------------
def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _payload_files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != STATE_FILE)


def gather_files(step_dir: Path, rank: int, world: int) -> dict[str, list]:
    """``{relative path: [size, crc32]}`` of every file under ``step_dir`` but state.json;
    each rank checksums every ``world``-th file and the shares are gathered."""
    mine = {
        str(p.relative_to(step_dir)): [p.stat().st_size, _crc32(p)]
        for p in _payload_files(step_dir)[rank::world]
    }
    if world == 1:
        return mine
    shares: list = [None] * world
    dist.all_gather_object(shares, mine)
    return {k: v for share in shares for k, v in share.items()}


def damage(path: str | os.PathLike, rank: int = 0, world: int = 1) -> str | None:
    """The first damaged file of a checkpoint in one sentence (None: intact).

    Checks state.json, then every file's size and CRC32 against the record written at save
    (this rank checks every ``world``-th file). Checkpoints written before sizes were
    recorded are checked for state.json only.
    """
    step_dir = Path(path)
    try:
        meta = json.loads((step_dir / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        return f"{step_dir / STATE_FILE} is unreadable ({type(e).__name__}: {e})"
    files = meta.get("files")
    if not isinstance(files, dict):
        return None
    for rel, (size, crc) in sorted(files.items())[rank::world]:
        p = step_dir / rel
        if not p.is_file():
            return f"{p} is missing"
        if p.stat().st_size != size:
            return f"{p} has {p.stat().st_size} bytes, {size} when saved (truncated?)"
        if _crc32(p) != crc:
            return f"{p} does not match the checksum recorded when it was saved"
    return None


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Raise CheckpointError naming the damaged file when a checkpoint is not intact.

    Collective when torch.distributed is initialized (every rank checks a share of the files);
    every rank raises the same error.
    """
    step_dir = Path(path)
    rank, world = rank_world()
    problems: list = [damage(step_dir, rank, world)]
    if world > 1:
        problems = [None] * world
        dist.all_gather_object(problems, damage(step_dir, rank, world))
    found = next((p for p in problems if p), None)
    if found:
        raise CheckpointError(
            f"checkpoint {step_dir.name} is damaged: {found}; resume from an older checkpoint "
            "(--resume falls back by itself) or delete this one."
        )


def find_intact(run_dir: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """The newest checkpoint of a run that passes ``verify_checkpoint`` (``latest`` first),
    and the one-line reasons of the damaged ones skipped on the way. Collective."""
    latest = find_latest(run_dir)
    ordered = [p for _, p in reversed(list_checkpoints(run_dir)) if p != latest]
    skipped = []
    for candidate in [latest, *ordered] if latest else ordered:
        try:
            verify_checkpoint(candidate)
        except CheckpointError as e:
            skipped.append(str(e))
            continue
        return candidate, skipped
    return None, skipped
