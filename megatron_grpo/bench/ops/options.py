"""``bench ops``'s command-line options (the command: ``bench/ops/run.py``; its
arguments: ``BenchOpsArgs``). Light: ``megatron-grpo --help`` builds them without torch."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset", default="tiny", help="model shape: tiny, Qwen2.5-0.5B, Qwen2.5-1.5B, Qwen2.5-7B"
    )
    p.add_argument("--rows", type=int, default=8, help="sequences in the batch")
    p.add_argument("--packs", type=int, default=2, help="packed micro-batches they are cut into")
    p.add_argument("--prompt-len", type=int, default=32, help="longest prompt")
    p.add_argument("--min-len", type=int, default=8, help="shortest response")
    p.add_argument("--max-len", type=int, default=48, help="longest response")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="weights (bf16: fp32 main weights in the optimizer, as on a GPU)")  # fmt: skip
    p.add_argument("--fused-adam", choices=("auto", "on", "off"), default="on",
                   help="optim.fused_adam (on: torch's fused AdamW, as auto gives on a GPU)")  # fmt: skip
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--seed", type=int, default=0, help="seed of the batch and the weights")
    p.add_argument("--top", type=int, default=12, help="rows of the top ops / sites tables")
    p.add_argument("--json", dest="json_out", help="write the results here")
    p.add_argument("--sides", default="project",
                   help="sides counted, project first: hf (padded, SDPA) and hf-packed (padding "
                   "removed, varlen attention): bench train's anchors, on the same batch and weights")  # fmt: skip
    p.add_argument("--recompute", default="none",
                   help="model.recompute settings counted, a comma list: none, full (the anchors: "
                   "gradient checkpointing)")  # fmt: skip
    p.add_argument("--loop", action="store_true",
                   help="instead: one tiny trainer step of the real loop (canned engine), its "
                   "host-sync-prone calls and Python time by site, inside and outside the policy")  # fmt: skip
    p.add_argument("--loop-micro-batches", default="2,4",
                   help="--loop: the packed micro-batches of each run, a comma list (which sites "
                   "grow with them)")  # fmt: skip
