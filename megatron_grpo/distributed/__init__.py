"""Process groups and parallel sizes: one init, one explicit ParallelContext passed on."""

from megatron_grpo.distributed.setup import (
    ParallelContext,
    destroy_distributed,
    distributed_context,
    init_distributed,
)
from megatron_grpo.distributed.validate import validate_parallel

__all__ = [
    "ParallelContext",
    "destroy_distributed",
    "distributed_context",
    "init_distributed",
    "validate_parallel",
]
