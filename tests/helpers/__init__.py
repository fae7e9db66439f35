"""What several test files share, one module a concern (README, "Development"):

- ``commands``: ``megatron-grpo`` and a plain vLLM reference run as subprocesses;
- ``runs``: real ``train`` runs (one process or torchrun) and their metrics rows;
- ``bench``: ``megatron-grpo bench`` on a very short real job;
- ``bridge``: reference executors and shards the bridge is checked against;
- ``layouts``: small specs (dense and MoE) and arange-filled HF weights;
- ``steps``: batches and losses for one policy train step;
- ``batches``: the step's staged values (``Rows``, ``AdvantagedBatch``, ``LossBatch``) from
  just the tensors a test cares about;
- ``configs``: a ``GRPOConfig`` from flat keys, each put in its section;
- ``numerics``: golden-value comparisons (and which CPU's table, ``cpu_kind``), a
  peak-memory probe, an attention reference;
- ``ranks``: spawned gloo ranks with results through a queue (transport tests).

Test files import from here, never from one another.
"""
