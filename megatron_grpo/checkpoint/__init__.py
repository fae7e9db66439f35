"""Checkpoint and resume of the training loop: dist_checkpointing shards + loop state + RNG."""

from megatron_grpo.checkpoint.core import (
    LoadedCheckpoint,
    LoopState,
    load_checkpoint,
    read_state,
    save_checkpoint,
)
from megatron_grpo.checkpoint.rng import get_rng_state, set_rng_state
from megatron_grpo.checkpoint.store import (
    CHECKPOINTS_DIR,
    LATEST_FILE,
    STATE_FILE,
    CheckpointError,
    damage,
    find_intact,
    find_latest,
    is_complete,
    list_checkpoints,
    resolve_checkpoint,
    step_dir_name,
    verify_checkpoint,
)

__all__ = [
    "CHECKPOINTS_DIR",
    "LATEST_FILE",
    "STATE_FILE",
    "CheckpointError",
    "LoadedCheckpoint",
    "LoopState",
    "damage",
    "find_intact",
    "find_latest",
    "get_rng_state",
    "is_complete",
    "list_checkpoints",
    "load_checkpoint",
    "read_state",
    "resolve_checkpoint",
    "save_checkpoint",
    "set_rng_state",
    "step_dir_name",
    "verify_checkpoint",
]
