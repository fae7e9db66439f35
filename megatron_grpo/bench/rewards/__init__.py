"""``megatron-grpo bench rewards``: a step's reward phase in-process against the same
reward served over HTTP on the loopback (``reward.name=http://...``)."""
