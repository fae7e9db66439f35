"""``megatron-grpo data``: prepare GSM8K / MATH / DeepScaleR-style sets into the configs' JSONL.

megatron-grpo data gsm8k|math|deepscaler --out FILE.jsonl [--split S] [--input FILE] [--limit N]

See ``megatron_grpo.data.prepare`` and docs/rewards-and-data.md.
"""

from __future__ import annotations

import argparse

from megatron_grpo.cli.command import add_command

NAMES = ("gsm8k", "math", "deepscaler")  # data/prepare.py PRESETS (light: --help needs no torch)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "data", run)
    p.add_argument("name", choices=NAMES, help="which data set's layout")
    p.add_argument("--out", required=True, help="JSONL file to write (e.g. data/gsm8k/train.jsonl)")
    p.add_argument("--split", default="train", help="hub split (default: train)")
    p.add_argument(
        "--input",
        help="a local .jsonl/.json/.parquet file in the hub's column layout (default: the "
        "hub, through the datasets library)",
    )
    p.add_argument("--limit", type=int, default=0, help="only the first N rows (0: all)")


def run(args: argparse.Namespace) -> int:
    """write a GSM8K / MATH / DeepScaleR set as the JSONL the configs read

    From the Hugging Face hub (the datasets library, online) or a local file in the hub's
    column layout (--input): one JSON line per row with the keys the shipped configs'
    data.prompt_key / data.answer_key name."""
    from megatron_grpo.cli.errors import exit_on_user_error
    from megatron_grpo.data.prepare import prepare

    with exit_on_user_error():
        n, preset = prepare(args.name, args.out, args.split, args.input, args.limit)
    keys = " / ".join(preset.keys)
    print(f"wrote {args.out}: {n} rows ({keys}); train on it with data.source={args.out} "
          f"data.prompt_key={preset.keys[0]} (as {preset.config} does)")  # fmt: skip
    return 0
