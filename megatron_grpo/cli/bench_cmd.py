"""``megatron-grpo bench``: measurements that print figures (docs/bridge.md).

megatron-grpo bench sync --model HF_DIR|PRESET --train-tp A --train-pp B --rollout-tp C
    [--bucket-mb X[,Y,...]] [--repeats N] [--sink vllm|null] --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--bucket-mb {text!r}: expected sizes in MB separated by commas, e.g. 16,64"
        ) from None


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (weight sync)")
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    s = bsub.add_parser(
        "sync",
        help="direct resharding bridge vs gather+broadcast baseline vs raw transfer",
        description="Spawns lcm(tp*pp, rollout-tp) local ranks, each a Megatron trainer rank "
        "hosting one colocated vLLM TP rank; runs the bridge, the baseline and a raw flat "
        "transfer of the same bytes over the same gloo group; prints a table, writes JSON.",
    )
    s.add_argument(
        "--model",
        default="tiny",
        help="HF model directory or preset (tiny, Qwen2.5-0.5B, Qwen2.5-1.5B, Qwen2.5-7B)",
    )
    s.add_argument("--train-tp", type=int, default=1)
    s.add_argument("--train-pp", type=int, default=1)
    s.add_argument("--rollout-tp", type=int, default=1)
    s.add_argument("--bucket-mb", type=_floats, default=[64.0], help="bucket size(s), e.g. 16,64")
    s.add_argument("--repeats", type=int, default=3, help="timed syncs per method (median)")
    s.add_argument(
        "--sink",
        choices=("vllm", "null"),
        default="vllm",
        help="vllm: load into real colocated engines; null: transfer only",
    )
    s.add_argument("--timeout-s", type=float, default=120.0, help="sync.timeout_s of the bridge")
    s.add_argument("--parity-tol", type=float, default=1e-3, help="max |logp diff| accepted")
    s.add_argument("--cache-dir", default="runs/bench", help="where presets are built")
    s.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    s.add_argument("--json", dest="json_out", help="write the results here")
    s.set_defaults(func=run_sync)


def run_sync(args: argparse.Namespace) -> int:
    from megatron_grpo.bench.sync import BenchSyncArgs, format_table, run_bench_sync
    from megatron_grpo.cli.errors import exit_on_user_error

    with exit_on_user_error():
        try:
            a = BenchSyncArgs(
                model=args.model, train_tp=args.train_tp, train_pp=args.train_pp,
                rollout_tp=args.rollout_tp, bucket_mb=args.bucket_mb, repeats=args.repeats,
                sink=args.sink, timeout_s=args.timeout_s, parity_tol=args.parity_tol,
                cache_dir=args.cache_dir, threads=args.threads,
            )  # fmt: skip
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        res = run_bench_sync(a)
    print(format_table(res))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(res, indent=2, default=str))
        print(f"wrote {args.json_out}")
    return 0 if res["verified"] else 1
