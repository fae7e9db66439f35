"""``megatron-grpo eval``: pass@k and mean reward of a model, generated through the bridge.

megatron-grpo eval --model HF_DIR|RUN_DIR|STEP_DIR|CKPT_DIR --data FILE|synthetic:TASK
    [--train-tp A] [--train-pp B] [--rollout-tp C] [--max-new-tokens N]
    [--greedy | --samples K] [--limit P] [--dump OUT.jsonl] [--hf-config HF_DIR]
    [--config FILE] [--verbose] [key=value ...]

See docs/eval.md and ``megatron_grpo.evaluation.evaluate``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_grpo.cli.command import add_command, quiet_console


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "eval", run)
    p.add_argument(
        "--model",
        required=True,
        help="HF directory, training run / checkpoints / step_NNNNNN directory, or a "
        "`convert hf-to-mcore` output",
    )
    p.add_argument("--data", required=True, help=".jsonl/.parquet file or synthetic:<task>")
    p.add_argument("--train-tp", type=int, default=1, help="Megatron tensor parallel size")
    p.add_argument("--train-pp", type=int, default=1, help="Megatron pipeline parallel size")
    p.add_argument("--rollout-tp", type=int, default=1, help="vLLM tensor parallel size")
    p.add_argument("--max-new-tokens", type=int, default=16)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--greedy", action="store_true", help="one greedy response per prompt (the default)"
    )
    mode.add_argument(
        "--samples", type=int, help="K samples per prompt at rollout.temperature (pass@K)"
    )
    p.add_argument("--limit", type=int, default=0, help="only the first P prompts (0: all)")
    p.add_argument("--dump", help="write one JSON line per response here")
    p.add_argument("--hf-config", help="HF directory with config.json + tokenizer files")
    p.add_argument("--config", help="YAML config for data/reward/rollout settings")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="limit for spawned ranks")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="print library output (warnings, vLLM INFO) on the console too; by default it "
        "goes to eval.log beside --dump, else in the training run's directory, else here",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")


def run(args: argparse.Namespace) -> int:
    """generate through Megatron -> bridge -> vLLM and report pass@1, pass@k, reward

    Loads the weights into the Megatron policy (TP x PP), sends them to colocated vLLM
    engines through the resharding bridge, generates for every prompt of --data, scores with
    reward.name and prints pass@1, pass@K and the mean reward. Spawns lcm(A*B, C) ranks
    itself, or runs as the torchrun world when WORLD_SIZE is set."""
    from megatron_grpo.cli.errors import exit_on_user_error

    out_file = quiet_console(log_dir(args.model, args.dump) / LOG_FILE, args.verbose)
    from megatron_grpo.evaluation import evaluate as ev

    with exit_on_user_error():
        settings = ev.prepare(
            model=args.model, data=args.data, train_tp=args.train_tp, train_pp=args.train_pp,
            rollout_tp=args.rollout_tp, max_new_tokens=args.max_new_tokens,
            samples=1 if args.samples is None else args.samples, greedy=args.samples is None, limit=args.limit,
            hf_config=args.hf_config, config=args.config, overrides=args.overrides,
            policy_logprobs=bool(args.dump),
        )  # fmt: skip
    out = ev.generate(settings, timeout_s=args.timeout_s)
    if out is None:  # a torchrun rank other than 0
        return 0
    res = ev.score(settings, out)
    print(ev.format_report(settings, res, out["layout"]), file=out_file(), flush=True)
    if args.dump:
        ev.write_dump(args.dump, res.rows)
        print(f"wrote {args.dump} ({len(res.rows)} responses)", file=out_file(), flush=True)
    return 0


LOG_FILE = "eval.log"


def log_dir(model: str, dump: str | None) -> Path:
    """Where eval.log goes: beside --dump, else the run directory of a training run /
    checkpoints / step_NNNNNN model, else the current directory (an HF or converted model's
    directory is not written to)."""
    if dump:
        return Path(dump).resolve().parent
    path = Path(model).resolve()
    for run in (path, path.parent, path.parent.parent):
        if (run / "config.yaml").is_file() and (run / "checkpoints").is_dir():
            return run
    return Path.cwd()
