"""``bench train``'s command-line options (the command: ``bench/train/run.py``; its
arguments: ``bench/train/args.py`` ``BenchTrainArgs``). Light: ``megatron-grpo --help``
builds them without torch."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset", default="tiny", help="model shape: tiny, Qwen2.5-0.5B, Qwen2.5-1.5B, Qwen2.5-7B"
    )
    p.add_argument("--rows", type=int, default=32, help="sequences in the batch")
    p.add_argument("--prompt-len", type=int, default=256,
                   help="longest prompt (prompts are 7/8 of it to all of it)")  # fmt: skip
    p.add_argument("--min-len", type=int, default=64, help="shortest response")
    p.add_argument("--max-len", type=int, default=1024, help="longest response")
    p.add_argument("--micro-batch-size", type=int, default=4, help="rows per micro-batch")
    p.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=None,
        help="project side: tokens per packed micro-batch (default micro-batch-size x "
        "(prompt-len + max-len), the trainer's grpo.batch.micro_batch_tokens=0; 0: padded rows "
        "like the HF side)",
    )
    p.add_argument(
        "--recompute",
        choices=("none", "full"),
        default="none",
        help="activation recompute on both sides (project model.recompute, HF gradient "
        "checkpointing)",
    )
    p.add_argument("--steps", type=int, default=5, help="timed repeats per phase (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repeats before them")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="both sides; auto: bf16 on GPU, fp32 on CPU")  # fmt: skip
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="device peak for MFU (default: H100/H200 989, H100 PCIe 756, A100 "
                   "312 by device name; n/a on CPU)")  # fmt: skip
    p.add_argument("--search", choices=("auto", "on", "off"), default="auto",
                   help="find the longest sequence that trains, per side (auto: on GPU only)")  # fmt: skip
    p.add_argument("--search-cap", type=int, default=32768, help="longest length tried")
    p.add_argument("--sides", default="project,hf,hf-packed",
                   help="sides measured, project first: project-padded (the project on "
                   "padded rows), hf (padded, SDPA) and hf-packed (padding removed, varlen "
                   "attention, the project's token budget)")  # fmt: skip
    p.add_argument("--liger", choices=("auto", "on", "off"), default="auto",
                   help="Liger-Kernel on the project side and hf-packed (auto: installed + CUDA)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the batch and the weights")
    p.add_argument("--json", dest="json_out", help="write the results here")
