"""The ``megatron-grpo`` command line: one subcommand per job.

Each subcommand lives in its own module and registers itself in ``SUBCOMMANDS`` with
``add_parser(subparsers)``, which sets ``func`` on its parser.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from megatron_grpo.cli.errors import exit_2_when_stopped, stop_as_usual

# module path -> subcommand name; modules are imported lazily so `--help` stays fast.
SUBCOMMANDS = {
    "megatron_grpo.cli.train_cmd": "train",
    "megatron_grpo.cli.convert_cmd": "convert",
    "megatron_grpo.cli.bench_cmd": "bench",
    "megatron_grpo.cli.plan_cmd": "plan",
    "megatron_grpo.cli.eval_cmd": "eval",
    "megatron_grpo.cli.data_cmd": "data",
}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``--help`` still shows the usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="megatron-grpo",
        description="Off-policy GRPO on Megatron-core with a TP/PP -> vLLM resharding bridge.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for module in SUBCOMMANDS:
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # First thing: a rank torchrun stops while its checks run exits 2 (cli/errors.py).
    exit_2_when_stopped()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "train":  # train sends library output to train.log (console.py)
        stop_as_usual()  # and is the one command whose ranks make checks under torchrun
        # megatron-core warns at import that it falls back from Transformer Engine / Apex to
        # its local implementation: expected on CPU, noise next to a command's one line.
        warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
