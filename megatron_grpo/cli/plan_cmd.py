"""``megatron-grpo plan``: the GPU-free dry run of a launch (see docs/launch.md).

Validates parallel sizes and the rank placement for ``--nodes x --gpus-per-node`` GPUs,
estimates memory per GPU and reports the bridge's bytes per weight sync. An impossible
plan ends with one ``error: ...`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_grpo.cli.command import add_command


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "plan", run_plan)
    cluster = p.add_argument_group("cluster")
    cluster.add_argument("--nodes", type=int, required=True, help="number of nodes")
    cluster.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per node")
    cluster.add_argument(
        "--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU in GiB (default 80)"
    )
    model = p.add_argument_group("model shape (when model.hf_path is not downloaded)")
    model.add_argument("--preset", help="plan with a preset's shape (e.g. Qwen2.5-7B)")
    model.add_argument("--model-config", help="plan with this HF config.json (or its directory)")
    run = p.add_argument_group("run")
    run.add_argument("--config", help="YAML config (default: the embedded tiny CPU default)")
    run.add_argument(
        "--recompute", action="store_true", help="estimate activations with full recompute"
    )
    run.add_argument(
        "--mean-interval",
        type=float,
        default=None,
        help="steps per sync observed in an adaptive run (summary.json mean_sync_interval)",
    )
    run.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="OUT", help="also write the plan as JSON ('-' = stdout)")


def run_plan(args: argparse.Namespace) -> int:
    """dry run of a launch without GPUs: ranks, memory per GPU, sync bytes

    Validate a launch (parallel sizes, which ranks train and serve, memory per GPU, bytes
    per weight sync) for a cluster shape, without GPUs or weights. The model shape comes
    from --model-config, --preset, or the config's model.hf_path (a preset name or a
    directory with config.json)."""
    from megatron_grpo.cli.errors import exit_on_user_error
    from megatron_grpo.config import load_config
    from megatron_grpo.dry_run import build_launch_plan
    from megatron_grpo.models.shapes import resolve_spec

    with exit_on_user_error():
        cfg = load_config(args.config, list(args.overrides))
        spec, source = resolve_spec(
            cfg.model.hf_path, model_config=args.model_config, preset=args.preset
        )
        plan = build_launch_plan(
            cfg, spec, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
            gpu_memory_gb=args.gpu_memory_gb, model=source, recompute=args.recompute,
            mean_interval=args.mean_interval,
        )  # fmt: skip
    data = plan.to_json()
    if args.json == "-":
        json.dump(data, sys.stdout, indent=2)
        print()
        return 0
    print(plan.table())
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
        print(f"plan written to {args.json}")
    return 0
