#!/usr/bin/env bash
# torchrun on ONE node (a workstation, a cloud VM, an interactive allocation):
#   NPROC=8 CONFIG=configs/qwen2.5-7b-throughput.yaml launchers/torchrun.sh [key=value ...]
#   PLAN=1 NPROC=8 CONFIG=... launchers/torchrun.sh   # dry run only: `megatron-grpo plan`
# For several nodes and for Slurm, use slurm/*.sbatch (docs/launch.md).
#
# Knobs (environment):
#   NPROC (or GPUS)  ranks to start (default: the GPUs nvidia-smi lists, else 1)
#   CONFIG           YAML config (default: the embedded tiny default)
#   RUN_DIR          run directory (default: the config's run_dir)
#   RESUME           auto (default): `train --resume auto`, which resumes when the run dir holds a
#                    checkpoint and starts afresh otherwise; 1: --resume (must resume); 0: neither
#   MAX_RESTARTS     torchrun --max-restarts: times a failed rank restarts the ranks, which resume
#                    from the latest checkpoint (default 0; docs/launch.md "Restarts")
#   MASTER_ADDR      rendezvous address (default 127.0.0.1)
#   MASTER_PORT      rendezvous port (default: a free port, torchrun --standalone)
#   PLAN             1: only run the GPU-free dry run for this node and exit
#   PLAN_ARGS        extra plan arguments (e.g. "--preset Qwen2.5-7B --gpu-memory-gb 141")
#   OMP_NUM_THREADS  threads per rank (default 1 on CPU-only machines, torchrun's otherwise)
#   TORCHRUN         the torchrun executable (default: torchrun through python -m
#                    megatron_grpo.distributed.quiet_torchrun, which leaves out torchrun's
#                    ChildFailedError report when every rank refused a bad input)
# Extra arguments are passed to `megatron-grpo train` (key=value overrides, --steps N, ...).
# Nothing outside the run directory is touched; no process but the ones started here is
# signalled (torchrun forwards SIGTERM/SIGINT to its own workers; the trainer then
# checkpoints and exits).
set -euo pipefail
cd "$(dirname "$0")/.."

if command -v nvidia-smi >/dev/null 2>&1; then
    detected=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
else
    detected=0
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
NPROC=${NPROC:-${GPUS:-$((detected > 0 ? detected : 1))}}
CONFIG=${CONFIG:-}
RUN_DIR=${RUN_DIR:-}
RESUME=${RESUME:-auto}
MAX_RESTARTS=${MAX_RESTARTS:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-}
PLAN=${PLAN:-0}
PLAN_ARGS=${PLAN_ARGS:-}
# Default: torchrun less its report of a refusal (megatron_grpo/distributed/quiet_torchrun.py).
if [[ -n "${TORCHRUN:-}" ]]; then
    launch=("$TORCHRUN")
else
    launch=("${PYTHON:-python}" -m megatron_grpo.distributed.quiet_torchrun)
fi

config_args=()
[[ -n "$CONFIG" ]] && config_args=(--config "$CONFIG")

if [[ "$PLAN" == 1 ]]; then
    plan_args=()
    if [[ -n "$PLAN_ARGS" ]]; then read -r -a plan_args <<<"$PLAN_ARGS"; fi
    exec "${PYTHON:-python}" -m megatron_grpo.cli.main plan "${config_args[@]}" --nodes 1 \
        --gpus-per-node "$NPROC" "${plan_args[@]}" "$@"
fi

train_args=("${config_args[@]}")
[[ -n "$RUN_DIR" ]] && train_args+=(--run-dir "$RUN_DIR")
case "$RESUME" in
    auto) train_args+=(--resume auto) ;;
    1) train_args+=(--resume) ;;
    0) ;;
    *) echo "error: RESUME=$RESUME: use auto, 1 or 0." >&2; exit 2 ;;
esac
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || { echo "error: MAX_RESTARTS=$MAX_RESTARTS: use a number >= 0." >&2; exit 2; }

if [[ -n "$MASTER_PORT" ]]; then
    rendezvous=(--nnodes=1 --node-rank=0 --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT")
else
    rendezvous=(--standalone)
fi

echo "torchrun.sh: $NPROC rank(s), ${CONFIG:-embedded default config}, train args: ${train_args[*]} $*"
exec "${launch[@]}" "${rendezvous[@]}" --nproc-per-node="$NPROC" --max-restarts="$MAX_RESTARTS" -m megatron_grpo.cli.main \
    train "${train_args[@]}" "$@"
