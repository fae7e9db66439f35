"""``bench sync``'s arguments and the model they name (the command: ``bench/sync/run.py``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from megatron_grpo.models.tiny import PRESETS, build_hf_model


@dataclass
class BenchSyncArgs:
    model: str = "tiny"
    """HF model directory or a preset of ``models/tiny.py``."""
    train_tp: int = 1
    train_pp: int = 1
    train_ep: int = 1
    """Expert-parallel trainer ranks (MoE models): must divide the trainer's DP size."""
    rollout_tp: int = 1
    bucket_mb: list[float] = field(default_factory=lambda: [64.0])
    repeats: int = 3
    sink: str = "vllm"
    """``vllm``: real colocated engines; ``null``: transfer only; ``vllm-fresh``: ``vllm``
    plus vLLM loading the same weights from a freshly written safetensors directory (its own
    loader, what a user without the bridge would do), timed side by side."""
    timeout_s: float = 120.0
    parity_tol: float = 1e-3
    cache_dir: str = "runs/bench"
    threads: int = 1
    """torch threads per rank (2-core machines: 1)."""

    def __post_init__(self) -> None:
        for k in ("train_tp", "train_pp", "train_ep", "rollout_tp", "repeats"):
            if getattr(self, k) < 1:
                raise ValueError(f"--{k.replace('_', '-')}={getattr(self, k)} must be >= 1.")
        if self.sink not in ("vllm", "null", "vllm-fresh"):
            raise ValueError(f"--sink={self.sink!r} must be 'vllm', 'vllm-fresh' or 'null'.")
        if not self.bucket_mb or any(b <= 0 for b in self.bucket_mb):
            raise ValueError(f"--bucket-mb={self.bucket_mb}: give positive sizes, e.g. 16,64.")

    @property
    def world(self) -> int:
        tp_pp = self.train_tp * self.train_pp
        return tp_pp * self.rollout_tp // math.gcd(tp_pp, self.rollout_tp)


def resolve_model(args: BenchSyncArgs) -> Path:
    if args.model in PRESETS:
        target = Path(args.cache_dir) / "hf_model" / args.model
        if not (target / "config.json").is_file():
            print(f"building random-weight {args.model} in {target} ...", flush=True)
            build_hf_model(target, args.model, with_tokenizer=True)
        return target
    path = Path(args.model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--model {args.model!r} is neither a preset ({sorted(PRESETS)}) nor an HF "
            "directory with a config.json."
        )
    return path
