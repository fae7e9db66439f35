"""``megatron-grpo bench``: measurements that print figures (docs/bridge.md).

megatron-grpo bench sync --model HF_DIR|PRESET --train-tp A --train-pp B --rollout-tp C
    [--bucket-mb X[,Y,...]] [--repeats N] [--sink vllm|vllm-fresh|null] --json OUT.json
megatron-grpo bench throughput [--config FILE] --v 1,2,5,10 [--ahead 0,3] --steps N [--warmup W]
    [--nproc P] [--out-dir DIR] --json OUT.json [key=value ...]
megatron-grpo bench project [--moe] [--json OUT.json] [--plot OUT.png]
megatron-grpo bench train [--preset P] [--rows R] [--max-len N] [--micro-batch-size M]
    [--steps S] [--device auto|cuda|cpu] --json OUT.json
megatron-grpo bench ops [--preset P] [--rows R] [--packs K] [--dtype bfloat16|float32]
    [--fused-adam auto|on|off] [--sides project,hf,hf-packed] [--recompute none,full] --json OUT.json
megatron-grpo bench ops --loop [--loop-micro-batches 2,4] --json OUT.json
megatron-grpo bench reproduce [--claims 1,2,3,4] [--seeds N] [--steps S] [--out-dir DIR]
    [key=value ...]
megatron-grpo bench control [--channels store,zmq] [--repeats N] [--samples S] [--tokens T]
    [--json OUT.json]
megatron-grpo bench rewards [--reward gsm8k|gsm8k_flexible|math] [--items N] [--concurrency C]
    [--batch-size B] [--repeats R] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from megatron_grpo.bench.ops.options import add_arguments as add_ops_arguments
from megatron_grpo.bench.train.options import add_arguments as add_train_arguments
from megatron_grpo.cli.command import add_command, from_args

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T")
A = TypeVar("A", bound="DataclassInstance")


def _comma_list(convert: Callable[[str], T], what: str, example: str):
    """An argparse ``type``: ``text`` split at commas, each piece ``convert``-ed (argparse
    names the option in front of the error)."""

    def parse(text: str) -> list[T]:
        try:
            return [convert(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected {what} separated by commas, e.g. {example}"
            ) from None

    return parse


_floats = _comma_list(float, "numbers", "16,64")
_names = _comma_list(str.strip, "names", "store,zmq")
_ints = _comma_list(int, "integers", "1,2,5,10")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="benchmarks (weight sync, throughput vs v, projection, train step vs HF)"
    )
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    s = add_command(bsub, "sync", run_sync)
    s.add_argument(
        "--model",
        default="tiny",
        help="HF model directory or preset (tiny, Qwen2.5-0.5B, Qwen2.5-1.5B, Qwen2.5-7B)",
    )
    s.add_argument("--train-tp", type=int, default=1)
    s.add_argument("--train-pp", type=int, default=1)
    s.add_argument(
        "--train-ep", type=int, default=1, help="expert-parallel trainer ranks (MoE models)"
    )
    s.add_argument("--rollout-tp", type=int, default=1)
    s.add_argument("--bucket-mb", type=_floats, default=[64.0], help="bucket size(s), e.g. 16,64")
    s.add_argument("--repeats", type=int, default=3, help="timed syncs per method (median)")
    s.add_argument(
        "--sink",
        choices=("vllm", "vllm-fresh", "null"),
        default="vllm",
        help="vllm: load into real colocated engines; vllm-fresh: also time vLLM loading the "
        "same weights from a fresh safetensors directory; null: transfer only",
    )
    s.add_argument("--timeout-s", type=float, default=120.0, help="sync.timeout_s of the bridge")
    s.add_argument("--parity-tol", type=float, default=1e-3, help="max |logp diff| accepted")
    s.add_argument("--cache-dir", default="runs/bench", help="where presets are built")
    s.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    s.add_argument("--json", dest="json_out", help="write the results here")
    _add_throughput(bsub)
    _add_project(bsub)
    _add_reproduce(bsub)
    add_train_arguments(add_command(bsub, "train", run_train))
    add_ops_arguments(add_command(bsub, "ops", run_ops))
    c = add_command(bsub, "control", run_control)
    c.add_argument("--channels", type=_names, default=["store", "zmq"],
                   help="store: the rendezvous-store channel it replaced; zmq: rollout/control.py")  # fmt: skip
    c.add_argument("--repeats", type=int, default=100, help="timed round trips per command")
    c.add_argument("--samples", type=int, default=64, help="samples in a generate's answer")
    c.add_argument("--tokens", type=int, default=256, help="response tokens per sample")
    c.add_argument("--timeout-s", type=float, default=300.0, help="time limit per channel")
    c.add_argument("--json", dest="json_out", help="also write the results here")
    e = add_command(bsub, "episodes", run_episodes)
    e.add_argument("--prompts", type=int, default=16, help="prompts per generate")
    e.add_argument("--samples", type=int, default=4, help="episodes per prompt")
    e.add_argument("--turns", type=int, default=4, help="model turns per episode")
    e.add_argument("--turn-tokens", type=int, default=16, help="model tokens per turn")
    e.add_argument("--repeats", type=int, default=3, help="timed generates per side (median)")
    e.add_argument("--preset", default="tiny", help="model shape (built with random weights)")
    e.add_argument("--cache-dir", default="runs/bench", help="where the model is built")
    e.add_argument("--timeout-s", type=float, default=600.0, help="time limit of the engine's rank")
    e.add_argument("--json", dest="json_out", help="also write the results here")
    r = add_command(bsub, "rewards", run_rewards)
    r.add_argument("--reward", default="gsm8k", help="the reward on both sides: gsm8k, "
                   "gsm8k_flexible or math")  # fmt: skip
    r.add_argument("--items", type=int, default=512, help="responses in the step")
    r.add_argument("--concurrency", type=int, default=64, help="remote requests in flight")
    r.add_argument("--batch-size", type=int, default=8, help="items per remote request")
    r.add_argument("--repeats", type=int, default=5, help="timed reward phases per side (median)")
    r.add_argument("--json", dest="json_out", help="also write the results here")


def run_rewards(args: argparse.Namespace) -> int:
    """a step's reward phase in-process against the same reward served over HTTP

    Scores --items GSM8K-like responses with --reward in-process, then through
    reward.name=http://... against the same reward in a server process on the loopback
    (bench/rewards/server.py), --concurrency requests of --batch-size items in flight: the
    median time of each side, their ratio, and whether the rewards are identical. Prints a
    table, writes JSON (docs/benchmarks.md, "bench rewards")."""
    from megatron_grpo.bench.rewards.run import BenchRewardsArgs, rewards_table, run_bench_rewards

    return _measure(args, BenchRewardsArgs, run_bench_rewards, rewards_table)


def run_control(args: argparse.Namespace) -> int:
    """a command's round trip over the disaggregated placement's control channel

    Two spawned processes on this machine, trainer rank 0 and one engine driver, exchange
    `update` (a tiny reply) and `generate` (--samples x --tokens sampled tokens back)
    commands as a disaggregated run does, heartbeats running; prints the median and p90 round
    trip of each command per channel: zmq (rollout/control.py) and store (the store-polling
    channel it replaced). Prints a table, writes JSON (docs/benchmarks.md, "bench control")."""
    from megatron_grpo.bench.control.run import BenchControlArgs, format_table, run_bench_control

    return _measure(args, BenchControlArgs, run_bench_control, format_table)


def run_episodes(args: argparse.Namespace) -> int:
    """multi-turn episodes against one-turn generation of as many model tokens

    One vLLM engine (a spawned rank, colocated as in training) generates --turns x
    --turn-tokens model tokens per sample in one turn, then as episodes of --turns turns of
    --turn-tokens tokens with a short environment reply between turns, through the agent
    loop (rollout/agent.py): model tokens per second of each and their ratio. Prints a
    table, writes JSON (docs/benchmarks.md, "bench episodes")."""
    from megatron_grpo.bench.episodes.run import (
        BenchEpisodesArgs,
        episodes_table,
        run_bench_episodes,
    )

    return _measure(args, BenchEpisodesArgs, run_bench_episodes, episodes_table)


def run_ops(args: argparse.Namespace) -> int:
    """ATen ops and host syncs of one train step and one log-prob pass

    Counts what the project's policy asks of the device for one GRPO batch cut into --packs
    packed micro-batches: the ATen ops dispatched (in total, per layer per micro-batch, the
    top ops and source sites), the calls that make the host wait for the device, by site,
    and on CUDA the profiler's kernel launches and synchronizations; FLOPs per useful token
    and bytes saved for the backward pass per token per layer. --sides adds bench train's
    HF anchors on the same batch and weights, --recompute none,full both settings, with the
    project/anchor ratios. Counts are deterministic: the suite holds the tiny figures to
    tests/op_budget.json and to the anchor's. --loop instead counts one tiny trainer step of
    the real loop (a canned engine where vLLM would be) at each --loop-micro-batches: its
    host-sync-prone calls and Python seconds by site, inside and outside the policy. Prints a
    table, writes JSON (docs/benchmarks.md, "bench ops")."""
    if args.loop:
        from megatron_grpo.bench.ops.loop import LoopArgs, loop_table, run_bench_loop

        return _measure(args, LoopArgs, run_bench_loop, loop_table)
    from megatron_grpo.bench.ops.run import BenchOpsArgs, ops_table, run_bench_ops

    return _measure(args, BenchOpsArgs, run_bench_ops, ops_table)


def run_train(args: argparse.Namespace) -> int:
    """the project's policy vs a plain Hugging Face model: train step and log-prob pass

    Builds the project's Policy (megatron-core, world size 1) and a transformers model of the
    same shape (SDPA attention, AdamW, fused on CUDA) from the same initial weights, and
    times both on one GRPO batch (prompts ~--prompt-len tokens, responses between --min-len
    and --max-len, right-padded): useful tokens/s, MFU, peak memory, their ratio, the
    log-prob difference of the two on the same weights, and (on GPU) the longest sequence
    each side trains. Prints a table, writes JSON (docs/benchmarks.md)."""
    from megatron_grpo.bench.train.args import BenchTrainArgs
    from megatron_grpo.bench.train.run import run_bench_train
    from megatron_grpo.bench.train.table import train_table

    return _measure(args, BenchTrainArgs, run_bench_train, train_table)


def _measure(
    args: argparse.Namespace,
    args_type: type[A],
    run: Callable[[A], Any],
    table: Callable[[Any], str],
) -> int:
    """``bench ops`` / ``bench train``: checked arguments (one line, exit 2), the libraries
    quiet, one in-process measurement, its table printed and its JSON written."""
    from megatron_grpo.cli.errors import exit_on

    with exit_on(ValueError, 2):  # ConfigError is a ValueError
        a = from_args(args_type, args)
    _quiet_libraries()
    res = run(a)
    if args.json_out:  # first: a table that fails to print loses no figure
        _write_json(res, args.json_out)
    print(table(res))
    return 0


def _add_throughput(bsub: argparse._SubParsersAction) -> None:
    t = add_command(bsub, "throughput", run_throughput)
    t.add_argument(
        "--config",
        help="YAML config (default: configs/tiny_cpu.yaml if present, else the embedded defaults)",
    )
    t.add_argument("--v", dest="vs", type=_ints, default=[1, 2, 5, 10], help="e.g. 1,2,5,10")
    t.add_argument("--steps", type=int, default=11, help="steps per run, warm-up included")
    t.add_argument("--warmup", type=int, default=1, help="leading steps left out of the rates")
    t.add_argument("--nproc", type=int, default=0,
                   help="ranks per run (torchrun when > 1); 0: tp*pp*max(dp,1) of the config "
                   "(pass it when parallel.dp is automatic)")  # fmt: skip
    t.add_argument("--ahead", dest="aheads", type=_ints, default=[0],
                   help="rollout.ahead values, e.g. 0,3: every (v, ahead) pair runs")  # fmt: skip
    t.add_argument("--no-pin", dest="pin", action="store_false",
                   help="disaggregated runs: do not pin trainer and rollout ranks to different "
                   "cores (default: pinned, half of the cores each)")  # fmt: skip
    t.add_argument("--rounds", type=int, default=1,
                   help="run every v this many times, round-robin, steps pooled")  # fmt: skip
    t.add_argument("--out-dir", default="runs/bench_throughput", help="run dirs and report")
    t.add_argument("--timeout-s", type=float, default=1800.0, help="time limit of one run")
    t.add_argument("--json", dest="json_out", help="also write the results here")
    t.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")


def _add_project(bsub: argparse._SubParsersAction) -> None:
    p = add_command(bsub, "project", run_project)
    p.add_argument("--trainer-tp", type=int, default=1, help="trainer TP of the 7B layout")
    p.add_argument("--trainer-pp", type=int, default=1, help="trainer PP of the 7B layout")
    p.add_argument("--v", dest="vs", type=_ints, default=[1, 2, 5, 10, 20])
    p.add_argument("--mean-interval", type=float, default=None,
                   help="also project an adaptive run's observed mean sync interval "
                        "(summary.json mean_sync_interval)")  # fmt: skip
    p.add_argument("--moe", action="store_true", help="instead: a Qwen3-30B-A3B sync, 8xH100")
    p.add_argument("--throughput-json", help="also check the model on a bench throughput JSON")
    p.add_argument("--json", dest="json_out", help="write the projection here")
    p.add_argument("--plot", help="write the ratio-vs-v plot here (PNG)")


def _add_reproduce(bsub: argparse._SubParsersAction) -> None:
    r = add_command(bsub, "reproduce", run_reproduce)
    r.add_argument("--claims", type=_ints, default=[1, 2, 3, 4], help="e.g. 1,2,3,4,5,6,7")
    r.add_argument("--seeds", type=int, default=3, help="seeds per variant (1..N)")
    r.add_argument("--steps", type=int, default=60, help="trainer steps per run")
    r.add_argument("--window", type=int, default=10, help="final-window length in steps")
    r.add_argument("--margin", type=float, default=0.05,
                   help="reward difference below which variants count as equal")  # fmt: skip
    r.add_argument("--z", type=float, default=None,
                   help="interval half-width in standard errors (default: Student t 95%%)")  # fmt: skip
    r.add_argument("--config", help="YAML config (default: the embedded tiny defaults)")
    r.add_argument("--nproc", type=int, default=0,
                   help="ranks per run (torchrun when > 1); 0: what the config needs")  # fmt: skip
    r.add_argument("--out-dir", default="runs/bench_reproduce", help="run dirs and report")
    r.add_argument("--timeout-s", type=float, default=1800.0, help="time limit of one run")
    r.add_argument("--from-json", metavar="JSON",
                   help="run nothing: re-analyze a reproduce.json (or an interrupted run's "
                   "curves.json) and write the report into --out-dir")  # fmt: skip
    r.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides applied to every run"
    )


def run_reproduce(args: argparse.Namespace) -> int:
    """the papers' claims at tiny scale: variants x seeds, curves, verdicts
    (docs/reproduction.md)

    Runs each claim's variants of `megatron-grpo train` (claim 1: v=1/4/8; 2: zero-variance
    mask on/off on a sparse-success task; 3: REC one-side clip (0.2,0.2) vs (0.6,2.0), with
    and without IS; 4: RED-Weight / RED-Drop vs GRPO at v=4; 5, only when named: adaptive
    sync vs fixed v at the same number of syncs and vs v=1) for --seeds seeds, round-robin,
    and writes claim<N>.png (claim 5 also claim5_sync.png: drift and interval), reproduce.json
    and reproduce.md (table and verdict per claim) into --out-dir. Prints the estimated wall time first."""
    from megatron_grpo.bench.common import BenchRunFailed
    from megatron_grpo.bench.reproduce.run import (
        ReproduceArgs,
        check_configs,
        report_from_json,
        run_bench_reproduce,
    )
    from megatron_grpo.cli.errors import exit_on

    if args.from_json:
        try:
            res = report_from_json(args.from_json, args.out_dir)
        except (OSError, ValueError, KeyError) as e:
            print(f"error: --from-json {args.from_json}: {e}", file=sys.stderr)
            return 2
        return _print_reproduce(res)
    with exit_on(ValueError, 2):  # ConfigError is a ValueError
        a = from_args(ReproduceArgs, args)
        a.nproc = check_configs(a)
    with exit_on(BenchRunFailed, 1):
        res = run_bench_reproduce(a)
    return _print_reproduce(res)


def _print_reproduce(res: dict) -> int:
    for c in res["claims"].values():
        print(f"claim {c['id']}: {c['verdict']} -- {c['title']}")
    for f in res["files"]:
        print(f"wrote {f}")
    return 0


def run_throughput(args: argparse.Namespace) -> int:
    """the training loop at several sync periods v, side by side (docs/benchmarks.md)

    Runs `megatron-grpo train` once per v (same config, seed and overrides; one after the
    other; under torchrun when --nproc > 1), reads each metrics.jsonl and reports steps/s,
    tokens/s and their ratio to the smallest v, the mean time per phase and the sync cost
    amortized per step. The first --warmup steps of every run are excluded. Writes JSON, two
    PNG plots and a markdown table into --out-dir."""
    from megatron_grpo.bench.common import BenchRunFailed, config_nproc
    from megatron_grpo.bench.throughput.report import throughput_table
    from megatron_grpo.bench.throughput.run import (
        ThroughputArgs,
        default_config,
        run_bench_throughput,
    )
    from megatron_grpo.cli.errors import exit_on

    with exit_on(ValueError, 2):
        config = args.config or default_config()
        nproc = args.nproc or config_nproc(config, args.overrides)
        a = from_args(ThroughputArgs, args, config=config, nproc=nproc)
    with exit_on(BenchRunFailed, 1):
        res = run_bench_throughput(a)
    print(throughput_table(res))
    print(res["warmup_note"])
    for f in res.get("files", []):
        print(f"wrote {f}")
    if args.json_out:
        _write_json(res, args.json_out)
    return 0


def run_project(args: argparse.Namespace) -> int:
    """step-time model of the paper's 1.35x (Qwen2.5-7B, 8xH100): where S comes from

    Calibrates step_time = T_other + S/v on the paper's two throughputs, computes the
    bridge's and the baseline's bytes per sync from the static plan, and predicts the
    v=1..20 throughput ratio for each sync-cost scenario. GPU-free, seconds."""
    from megatron_grpo.bench.projection.model import Assumptions, calibrate_from_throughput, project
    from megatron_grpo.bench.projection.table import format_projection, print_moe_sync

    if args.moe:  # instead: one MoE sync from the static plan (bench/projection/moe.py)
        return print_moe_sync(args.json_out)
    try:
        p = project(Assumptions(trainer_tp=args.trainer_tp, trainer_pp=args.trainer_pp),
                    vs=args.vs, mean_interval=args.mean_interval)  # fmt: skip
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_projection(p))
    if args.throughput_json:
        check = calibrate_from_throughput(json.loads(Path(args.throughput_json).read_text()))
        p["measured_check"] = check
        print(
            f"\nModel vs measured ({args.throughput_json}): T_other={check['t_other_s']:.3f} "
            f"s, S={check['sync_s']:.3f} s from v={check['reference_v']}"
        )
        for r in check["rows"]:
            print(
                f"  v={r['v']:>3}: predicted {r['predicted_ratio']:.3f}, "
                f"measured {r['measured_ratio']:.3f}"
            )
    if args.plot:
        from megatron_grpo.bench.throughput.report import plot_projection

        print(f"wrote {plot_projection(p, args.plot)}")
    if args.json_out:
        _write_json(p, args.json_out)
    return 0


def run_sync(args: argparse.Namespace) -> int:
    """direct resharding bridge vs gather+broadcast baseline vs raw transfer

    Spawns lcm(tp*pp, rollout-tp) local ranks, each a Megatron trainer rank hosting one
    colocated vLLM TP rank; runs the bridge, the baseline and a raw flat transfer of the
    same bytes over the same gloo group; prints a table, writes JSON."""
    from megatron_grpo.bench.sync.args import BenchSyncArgs
    from megatron_grpo.bench.sync.run import run_bench_sync
    from megatron_grpo.bench.sync.summary import sync_table
    from megatron_grpo.cli.errors import exit_on_user_error

    with exit_on_user_error():
        try:
            a = from_args(BenchSyncArgs, args)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        res = run_bench_sync(a)
    print(sync_table(res))
    if args.json_out:
        _write_json(res, args.json_out)
    return 0 if res["verified"] else 1


def _quiet_libraries() -> None:
    """The in-process benches print their table, not megatron-core's or transformers'
    warnings (GPTModel's deprecation notice at every build, experimental-API notices)."""
    import logging
    import warnings

    warnings.simplefilter("ignore")
    for name in ("megatron", "megatron.core", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _write_json(res: dict, path: str) -> None:
    from megatron_grpo.bench.common import write_json

    write_json(res, path)
    print(f"wrote {path}")
