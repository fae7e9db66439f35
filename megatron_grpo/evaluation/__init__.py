"""``megatron-grpo eval``: model sources (``source``), generation through the bridge, pass@k
(``metrics.pass_at_k``), dump and report (``evaluate``); docs/eval.md."""
