"""The typed config tree (schema) and its YAML/override loader."""

from megatron_grpo.config.loader import format_config, load_config, parse_overrides, save_config
from megatron_grpo.config.schema import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    EvalConfig,
    GRPOConfig,
    KernelsConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RewardConfig,
    RolloutConfig,
    SyncConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "GRPOConfig",
    "EvalConfig",
    "KernelsConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RewardConfig",
    "RolloutConfig",
    "SyncConfig",
    "format_config",
    "load_config",
    "parse_overrides",
    "save_config",
]
