"""The CPU compatibility layer for megatron-core and the pinned-version checks."""
