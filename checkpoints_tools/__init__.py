"""Checkpoint conversion on top of megatron_grpo.layouts: HF safetensors <-> megatron-core
dist checkpoints (``megatron-grpo convert ...``; docs/convert.md). The converted directory's
format and the shared steps are ``megatron_grpo.checkpoint.conversion`` (eval reads it too);
only the ``convert`` command (``megatron_grpo/cli/convert_cmd.py``) imports this package."""

from checkpoints_tools.hf_to_mcore import hf_to_mcore
from checkpoints_tools.inspect_ckpt import inspect_checkpoint
from checkpoints_tools.mcore_to_hf import mcore_to_hf, write_safetensors
from megatron_grpo.checkpoint.conversion import CheckpointInfo, ConvertError

__all__ = [
    "CheckpointInfo",
    "ConvertError",
    "hf_to_mcore",
    "inspect_checkpoint",
    "mcore_to_hf",
    "write_safetensors",
]
