"""``megatron-grpo train``: the off-policy GRPO loop (Algorithm 1) on Megatron-core + vLLM.

Run it under torchrun (each rank runs the same command) or as one process; see
docs/launch.md. ``megatron-grpo demo`` runs it on the embedded default with the CPU launcher.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Literal

from megatron_grpo.cli.command import add_command


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "train", run)
    p.add_argument(
        "--config",
        help="YAML config (default: when resuming, the run directory's config.yaml; else the "
        "embedded tiny CPU default)",
    )
    p.add_argument("--run-dir", help="run directory (overrides run_dir)")
    p.add_argument("--steps", type=int, help="number of trainer steps (overrides steps)")
    p.add_argument("--sync-interval", type=int, help="v: sync vLLM every v steps (sync.interval)")
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="auto",
        help="continue from the latest checkpoint in the run dir, with its config.yaml unless "
        "--config is given (--steps N past the last step trains a finished run further); "
        "`--resume auto`: when it has one, else start afresh (the same command line for every "
        "launch and restart)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the run already in the run dir and start afresh (default: refuse it)",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="print library output (warnings, vLLM INFO, the config) on the console too; by "
        "default it goes to RUN_DIR/train.log",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")


def overrides_from_args(args: argparse.Namespace) -> list[str]:
    overrides = list(args.overrides)
    if isinstance(args.resume, str) and args.resume != "auto":
        # `--resume key=value`: argparse gave the optional value the first override
        overrides.insert(0, args.resume)
    if args.run_dir:
        overrides.append(f"run_dir={args.run_dir}")
    if args.steps is not None:
        overrides.append(f"steps={args.steps}")
    if args.sync_interval is not None:
        overrides.append(f"sync.interval={args.sync_interval}")
    return overrides


def run(args: argparse.Namespace) -> int:
    """run off-policy GRPO training (under torchrun for several ranks)

    Off-policy GRPO: rollouts from vLLM serving a policy that is refreshed every v steps,
    Megatron-core training. Settings come from the config file, then key=value overrides
    (dotted keys, e.g. grpo.group_size=16)."""
    from megatron_grpo.cli.errors import exit_on_user_error, stop_as_usual
    from megatron_grpo.config import load_config

    rank = int(os.environ.get("RANK", "0"))
    # Every rank makes every check and reaches the same verdict (trainer/run_dir.py) before
    # any rank writes: a refused run exits 2 on each rank, rank 0 prints the one line (the
    # others wait for torchrun to stop them: docs/errors.md), and the run directory is left
    # as it was.
    with exit_on_user_error(alike_on_every_rank=True):
        overrides = overrides_from_args(args)
        if args.config is not None or not args.resume:
            load_config(args.config, overrides)  # its refusals before torch loads (seconds)
        from megatron_grpo.distributed.spawn import ranks_needed, run_under_torchrun
        from megatron_grpo.trainer.preflight import check_run
        from megatron_grpo.trainer.run_dir import clear_run_dir, plan_start, run_config

        resume: bool | Literal["auto"] = "auto" if args.resume == "auto" else bool(args.resume)
        # --resume without --config: the run's own config.yaml (trainer/run_dir.py)
        cfg, config = run_config(args.config, overrides, resume)
        start = plan_start(cfg.run_dir, overwrite=args.overwrite, resume=resume, steps=cfg.steps)
        spawn = "WORLD_SIZE" not in os.environ and cfg.rollout.placement == "colocated"
        nproc = ranks_needed(cfg) if spawn else int(os.environ.get("WORLD_SIZE", "1"))
        if cfg.rollout.placement == "colocated":
            check_run(cfg, nproc)  # every check that can fail, before any rank or model
    stop_as_usual()  # checked: a stop from now on is not a refusal (cli/errors.py)
    with exit_on_user_error():
        if rank == 0:
            clear_run_dir(start.stale)  # --overwrite, once everything else has been checked
        if spawn and nproc > 1:  # one process asked for a layout of several ranks: start them
            print(f"[megatron-grpo] starting {nproc} ranks under torchrun", flush=True)
            return run_under_torchrun(_rank_argv(args, config), nproc)
        if not args.verbose:
            from megatron_grpo.metrics.console import LOG_FILE, capture, say

            capture(Path(cfg.run_dir) / LOG_FILE, rank)
            if rank == 0:
                say(f"library output goes to {Path(cfg.run_dir) / LOG_FILE} (--verbose shows it)")
        from megatron_grpo.trainer.build import train

        train(cfg, resume=start.resume)
    return 0


def _rank_argv(args: argparse.Namespace, config: str | None) -> list[str]:
    """This command for the spawned ranks, with ``config``, the file this process loaded
    (--overwrite, or --resume auto starting afresh, has already cleared the run dir)."""
    argv = ["train"]
    if config:
        argv += ["--config", config]
    if args.resume:
        argv += ["--resume", "auto"] if args.resume == "auto" else ["--resume"]
    argv += ["--verbose"] * args.verbose
    return argv + overrides_from_args(args)
