"""``megatron-grpo convert``: HF <-> megatron-core dist checkpoints (docs/convert.md).

megatron-grpo convert hf-to-mcore --hf HF_DIR --out CKPT_DIR [--dtype D]
megatron-grpo convert mcore-to-hf --ckpt CKPT_DIR --out HF_DIR [--hf-config HF_DIR] [--dtype D]
megatron-grpo convert inspect --ckpt CKPT_DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_grpo.cli.command import quiet_console

DTYPE_CHOICES = ("float32", "bfloat16", "float16")
LOG_FILE = "convert.log"
VERBOSE_HELP = (
    "print library output (warnings) on the console too; by default it goes to convert.log "
    "in --out's parent directory"
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert checkpoints between HF safetensors and megatron-core dist checkpoints",
        description="Checkpoint conversion. Outputs are written to a temporary directory and "
        "renamed when complete; an existing --out is never overwritten.",
    )
    csub = p.add_subparsers(dest="convert_command", metavar="ACTION", required=True)

    a = csub.add_parser("hf-to-mcore", help="HF directory -> megatron dist checkpoint")
    a.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    a.add_argument("--out", required=True, help="checkpoint directory to create")
    a.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        help="stored dtype (default: the source's; a "
        "lower precision is written only when asked for here)",
    )
    a.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    a.set_defaults(func=run_hf_to_mcore)

    b = csub.add_parser("mcore-to-hf", help="megatron dist checkpoint -> HF directory")
    b.add_argument(
        "--ckpt",
        required=True,
        help="converted checkpoint, training step dir or a run's checkpoints/ dir",
    )
    b.add_argument("--out", required=True, help="HF directory to create")
    b.add_argument(
        "--hf-config",
        help="HF directory with config.json and tokenizer files (default: the checkpoint's "
        "hf/, or for a training run the model its config.yaml names)",
    )
    b.add_argument(
        "--dtype", choices=DTYPE_CHOICES, help="output dtype (default: the checkpoint's)"
    )
    b.add_argument("--max-shard-gb", type=float, default=2.0, help="safetensors shard size limit")
    b.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    b.set_defaults(func=run_mcore_to_hf)

    c = csub.add_parser("inspect", help="print a checkpoint's model, dtype and tensors")
    c.add_argument("--ckpt", required=True)
    c.set_defaults(func=run_inspect)


def _user_errors(fn):
    def wrapped(args: argparse.Namespace) -> int:
        if hasattr(args, "verbose"):  # a conversion (inspect prints what it reads)
            args.console = quiet_console(Path(args.out).resolve().parent / LOG_FILE, args.verbose)
        from megatron_grpo.checkpoint.conversion import ConvertError
        from megatron_grpo.cli.errors import exit_on_user_error
        from megatron_grpo.layouts.io import CheckpointError
        from megatron_grpo.layouts.megatron import UnknownParameterError

        with exit_on_user_error():
            try:
                return fn(args)
            except (ConvertError, CheckpointError, UnknownParameterError) as e:
                from megatron_grpo.metrics.console import console_err

                print(f"error: {e}", file=console_err())
                return 2

    return wrapped


@_user_errors
def run_hf_to_mcore(args: argparse.Namespace) -> int:
    from checkpoints_tools import hf_to_mcore

    info = hf_to_mcore(args.hf, args.out, dtype=args.dtype)
    print(f"wrote {args.out}: {info.spec['architecture']} in {info.dtype}", file=args.console())
    return 0


@_user_errors
def run_mcore_to_hf(args: argparse.Namespace) -> int:
    from checkpoints_tools import mcore_to_hf

    out = mcore_to_hf(
        args.ckpt, args.out, hf_config=args.hf_config, dtype=args.dtype,
        max_shard_bytes=int(args.max_shard_gb * 1024**3),
    )  # fmt: skip
    print(
        f"wrote {out['out']}: {len(out['files'])} safetensors file(s) in {out['dtype']}",
        file=args.console(),
    )
    return 0


@_user_errors
def run_inspect(args: argparse.Namespace) -> int:
    from checkpoints_tools import inspect_checkpoint
    from megatron_grpo.metrics.console import console_out

    print("\n".join(inspect_checkpoint(args.ckpt)), file=console_out())
    return 0
