"""``megatron-grpo bench episodes``: multi-turn generation against one-turn generation of as
many model tokens on the same engine (docs/benchmarks.md, "bench episodes")."""
