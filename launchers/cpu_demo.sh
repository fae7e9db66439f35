#!/usr/bin/env bash
# The CPU launcher that `make demo` uses: torchrun on this machine, the embedded default
# config (configs/tiny_cpu.yaml), a run directory under runs/.
#
# Knobs (environment):
#   NPROC    ranks to start (default 2: trainer TP=2, each rank hosting its vLLM rank)
#   CONFIG   YAML config (default configs/tiny_cpu.yaml)
#   RUN_DIR  run directory (default runs/demo; an existing one is started over)
# Extra arguments are passed to `megatron-grpo train` (e.g. key=value overrides).
# Nothing outside the run directory is touched; no process is killed.
set -euo pipefail
cd "$(dirname "$0")/.."

NPROC=${NPROC:-2}
CONFIG=${CONFIG:-configs/tiny_cpu.yaml}
RUN_DIR=${RUN_DIR:-runs/demo}

# One OpenMP thread per rank: the ranks share the machine's cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
start=$(date +%s)
# torchrun, less its ChildFailedError report when the ranks refused a bad input (exit 2):
# the ranks' one `error:` line stays the last (megatron_grpo/distributed/quiet_torchrun.py).
"${PYTHON:-python}" -m megatron_grpo.distributed.quiet_torchrun --standalone --nproc-per-node "$NPROC" -m megatron_grpo.cli.main \
    train --config "$CONFIG" --run-dir "$RUN_DIR" --overwrite "$@"
echo "demo finished in $(( $(date +%s) - start )) s; run directory: $RUN_DIR"
