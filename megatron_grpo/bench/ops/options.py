"""``bench ops``'s command-line options (the command: ``bench/ops/run.py``; its
arguments: ``BenchOpsArgs``). Light: ``megatron-grpo --help`` builds them without torch."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset", default="tiny", help="model shape: tiny, Qwen2.5-0.5B, Qwen2.5-1.5B, Qwen2.5-7B"
    )
    parser.add_argument("--rows", type=int, default=8, help="sequences in the batch")
    parser.add_argument(
        "--packs", type=int, default=2, help="packed micro-batches they are cut into"
    )
    parser.add_argument("--prompt-len", type=int, default=32, help="longest prompt")
    parser.add_argument("--min-len", type=int, default=8, help="shortest response")
    parser.add_argument("--max-len", type=int, default=48, help="longest response")
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="weights (bf16: fp32 main weights in the optimizer, as on a GPU)",
    )
    parser.add_argument(
        "--fused-adam",
        choices=("auto", "on", "off"),
        default="on",
        help="optim.fused_adam (on: torch's fused AdamW, as auto gives on a GPU)",
    )
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batch and the weights")
    parser.add_argument("--top", type=int, default=12, help="rows of the top ops / sites tables")
    parser.add_argument("--json", dest="json_out", help="write the results here")
