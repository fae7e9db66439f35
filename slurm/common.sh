# shellcheck shell=bash
# The MG_* arrays defined here are used by the templates that source this file.
# shellcheck disable=SC2034
# Shared logic of the sbatch templates in slurm/: knobs, rendezvous from the Slurm
# environment, resume detection, the GPU-free preflight plan, and preemption handling.
# Sourced by each template, which then ends in
#     srun "${MG_SRUN_ARGS[@]}" "${MG_TORCHRUN[@]}" "${MG_TORCHRUN_ARGS[@]}" -m megatron_grpo.cli.main \
#         train "${MG_TRAIN_ARGS[@]}" "$@" &
#     mg_wait_step $!
#
# Knobs (environment; all optional):
#   REPO            repository root (default: $SLURM_SUBMIT_DIR, i.e. submit from the repo root)
#   CONFIG          YAML config (default: the embedded tiny default)
#   RUN_DIR         run directory (default: runs/$SLURM_JOB_NAME-$SLURM_JOB_ID); a requeued job
#                   keeps its job id, so it finds its own checkpoints and resumes
#   GPUS_PER_NODE   ranks per node (default: $SLURM_GPUS_ON_NODE, else 8)
#   MASTER_PORT     rendezvous port (default: 20000 + job id % 40000)
#   SRUN_MPI        e.g. pmix: `srun --mpi=pmix` for sites whose NCCL/UCX setup wants PMIx
#   PREFLIGHT       1 (default): run `megatron-grpo plan` for this allocation before srun;
#                   an impossible plan fails the job in seconds instead of on the GPUs
#   PLAN_ARGS       extra arguments to that plan (e.g. "--preset Qwen2.5-7B --gpu-memory-gb 141")
#   RESUME          auto (default): `train --resume auto`, which resumes when RUN_DIR holds a
#                   checkpoint and starts afresh otherwise; 1: --resume (must resume); 0: neither
#   MAX_RESTARTS    torchrun --max-restarts: in-job restarts of every node's ranks after a rank
#                   fails, on every node; they resume from the latest checkpoint (default 2;
#                   0 turns them off; each node's torchrun counts the restarts of its own
#                   failures, docs/launch.md "Restarts";
#                   a configuration refusal prints its line once, the later attempts exit
#                   quietly; docs/launch.md "Restarts"). A pre-emption warning is not a
#                   failure: it requeues instead
#   GRACE_S         seconds torchrun lets its workers finish a step and checkpoint after the
#                   warning signal before it kills them (default 110; keep it below the lead
#                   time of `#SBATCH --signal`)
#   MAX_REQUEUES    requeues after pre-emption warnings before the job stops instead (default
#                   10; compared with SLURM_RESTART_COUNT)
#   LOG_DIR         per-rank logs of every node (torchrun --log-dir/--tee; default
#                   logs/$SLURM_JOB_NAME-$SLURM_JOB_ID); srun --label prefixes the job log's
#                   lines with the task (node) number
#   CONTAINER_IMAGE pyxis/enroot image (e.g. a .sqsh file or nvcr.io#nvidia/pytorch:...):
#                   srun --container-image; unset (default) runs on the host
#   CONTAINER_MOUNTS srun --container-mounts (default: the repository, mounted at its path)
#   TORCHRUN        the torchrun executable on each node (default: torchrun through `$PYTHON -m
#                   megatron_grpo.distributed.quiet_torchrun`, which leaves out torchrun's
#                   ChildFailedError report after a configuration refusal: the job log then
#                   holds the one error line; any other failure prints torchrun's report)
#   NCCL_* / UCX_*  exported variables reach every task (srun --export=ALL); see
#                   docs/launch.md "NCCL settings"
#
# Preemption: `#SBATCH --signal=B:USR1@120` sends USR1 to this batch shell only. The trap
# below forwards it to the srun step this script started (never to anything else); srun
# forwards it to its torchrun tasks, torchrun (--signals-to-handle) to its
# workers, and the trainer finishes its step, saves a checkpoint and exits 0. The script
# then requeues the job (`scontrol requeue`, needs `#SBATCH --requeue`) only if a checkpoint
# was completed after the warning (`checkpoints/latest` replaced since then: torchrun's own
# exit status is 1 after any handled signal, so it cannot tell), the run is not complete
# and the job was requeued fewer than MAX_REQUEUES times; otherwise it exits non-zero. The
# requeued job starts this script again and resumes. A SIGTERM (scancel, or
# Slurm's own preemption, which requeues a --requeue job itself) is forwarded the same way
# but never requeues.

set -euo pipefail

mg_die() {
    echo "megatron-grpo slurm: error: $*" >&2
    exit 2
}

mg_log() {
    echo "megatron-grpo slurm: $*"
}

: "${SLURM_JOB_ID:?not inside a Slurm job: submit this script with sbatch}"
: "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set: submit this script with sbatch}"

REPO=${REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
[[ -f "$REPO/slurm/common.sh" ]] \
    || mg_die "REPO=$REPO is not the megatron-grpo repository: submit from the repository root or set REPO."
cd "$REPO"

CONFIG=${CONFIG:-}
RUN_DIR=${RUN_DIR:-runs/${SLURM_JOB_NAME:-megatron-grpo}-$SLURM_JOB_ID}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
NNODES=${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-1}}
MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 40000))}
PREFLIGHT=${PREFLIGHT:-1}
PLAN_ARGS=${PLAN_ARGS:-}
RESUME=${RESUME:-auto}
GRACE_S=${GRACE_S:-110}
SRUN_MPI=${SRUN_MPI:-}
PYTHON=${PYTHON:-python}
MAX_REQUEUES=${MAX_REQUEUES:-10}
# Across nodes, torchrun's agent of a node whose ranks did not fail restarts them with its
# TORCHELASTIC_RESTART_COUNT unchanged; the restarted ranks agree the attempt through the
# store instead (distributed/setup.py attempt_store), so restarts work there too.
MAX_RESTARTS=${MAX_RESTARTS:-2}
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || mg_die "MAX_RESTARTS=$MAX_RESTARTS: use a number >= 0."
LOG_DIR=${LOG_DIR:-logs/${SLURM_JOB_NAME:-megatron-grpo}-$SLURM_JOB_ID}
CONTAINER_IMAGE=${CONTAINER_IMAGE:-}
CONTAINER_MOUNTS=${CONTAINER_MOUNTS:-$REPO:$REPO}

# Rendezvous: the first host of the allocation serves torchrun's c10d store.
mapfile -t MG_HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
((${#MG_HOSTS[@]} > 0)) || mg_die "scontrol show hostnames $SLURM_JOB_NODELIST printed no host."
MASTER_ADDR=${MASTER_ADDR:-${MG_HOSTS[0]}}
export MASTER_ADDR MASTER_PORT


MG_CONFIG_ARGS=()
[[ -n "$CONFIG" ]] && MG_CONFIG_ARGS=(--config "$CONFIG")

mg_has_checkpoint() {
    [[ -f "$RUN_DIR/checkpoints/latest" ]]
}

# The run is complete when the latest checkpoint is at the configured last step
# (checkpoint/core.py writes `latest` = "step_000123"; the trainer saves config.yaml).
mg_run_complete() {
    mg_has_checkpoint && [[ -f "$RUN_DIR/config.yaml" ]] || return 1
    local total latest
    total=$(sed -n 's/^steps: *//p' "$RUN_DIR/config.yaml")
    latest=$(<"$RUN_DIR/checkpoints/latest")
    latest=${latest##*step_}
    [[ -n "$total" ]] && ((10#$latest >= total))
}

# A checkpoint was completed at or after epoch second $1 (checkpoint/core.py replaces
# `latest` atomically as the last act of a save).
mg_saved_since() {
    mg_has_checkpoint && (($(stat -c %Y "$RUN_DIR/checkpoints/latest") >= $1))
}

MG_TRAIN_ARGS=("${MG_CONFIG_ARGS[@]}" --run-dir "$RUN_DIR")
case "$RESUME" in
    auto) MG_TRAIN_ARGS+=(--resume auto) ;;
    1) MG_TRAIN_ARGS+=(--resume) ;;
    0) ;;
    *) mg_die "RESUME=$RESUME: use auto, 1 or 0." ;;
esac

MG_SRUN_ARGS=(--nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 --label)
[[ -n "$SRUN_MPI" ]] && MG_SRUN_ARGS+=(--mpi="$SRUN_MPI")
# Steps do not inherit the job's --cpus-per-task since Slurm 22.05 (srun(1)): without it a
# step task gets one CPU and torchrun's data loaders, reward workers and vLLM share it.
[[ -n "${SLURM_CPUS_PER_TASK:-}" ]] && MG_SRUN_ARGS+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
if [[ -n "$CONTAINER_IMAGE" ]]; then
    MG_SRUN_ARGS+=(--container-image="$CONTAINER_IMAGE" --container-mounts="$CONTAINER_MOUNTS"
        --container-workdir="$REPO")
fi
# torchrun less its report of a refusal (megatron_grpo/distributed/quiet_torchrun.py).
if [[ -n "${TORCHRUN:-}" ]]; then
    MG_TORCHRUN=("$TORCHRUN")
else
    MG_TORCHRUN=("$PYTHON" -m megatron_grpo.distributed.quiet_torchrun)
fi
# --signals-to-handle: torchrun forwards these to its workers and then waits
# --shutdown-timeout seconds for them before SIGKILL (torch/distributed/run.py; USR1 is not
# in its default list, and without it torchrun dies of USR1 and orphans its workers).
MG_TORCHRUN_ARGS=(
    --nnodes="$NNODES" --nproc-per-node="$GPUS_PER_NODE" --max-restarts="$MAX_RESTARTS"
    "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" --shutdown-timeout="$GRACE_S"
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"
    --rdzv-id="$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"
    # Every rank's stdout/stderr to a file of its own as well as to the job log (torchrun
    # makes a unique sub-directory per node and attempt under LOG_DIR).
    --log-dir="$LOG_DIR" --tee=3
)

# The key=value overrides among the train arguments (the plan takes no --steps etc.).
mg_kv_only() {
    MG_KV=()
    local a
    for a in "$@"; do
        if [[ "$a" == *=* && "$a" != -* ]]; then MG_KV+=("$a"); fi
    done
}

# A value of the resolved config (CONFIG plus the given key=value overrides), e.g.
# `mg_config_value rollout.tp "$@"`: the config tree stays the one source of truth.
mg_config_value() {
    local key=$1
    shift
    mg_kv_only "$@"
    "$PYTHON" - "$key" "${CONFIG:-}" "${MG_KV[@]}" <<'PY' || mg_die "cannot read $key from the config (above)."
import sys
from megatron_grpo.config import load_config
key, path, *overrides = sys.argv[1:]
value = load_config(path or None, overrides)
for part in key.split("."):
    value = getattr(value, part)
print(value)
PY
}

# The GPU-free dry run of this allocation: placement, parallel sizes, memory, sync bytes.
# Arguments: the train arguments; only the key=value overrides among them are used.
mg_preflight() {
    [[ "$PREFLIGHT" == 1 ]] || return 0
    mg_kv_only "$@"
    local -a plan_args=()
    if [[ -n "$PLAN_ARGS" ]]; then read -r -a plan_args <<<"$PLAN_ARGS"; fi
    "$PYTHON" -m megatron_grpo.cli.main plan "${MG_CONFIG_ARGS[@]}" --nodes "$NNODES" \
        --gpus-per-node "$GPUS_PER_NODE" "${plan_args[@]}" "${MG_KV[@]}" \
        || mg_die "the preflight plan failed (above): fix the config, or set PREFLIGHT=0 to skip it."
}

MG_STEP_PID=""
MG_SIGNAL=""
MG_SIGNAL_TIME=0
mg_forward() {
    MG_SIGNAL=$1
    MG_SIGNAL_TIME=$(date +%s)
    if [[ -n "$MG_STEP_PID" ]]; then
        mg_log "got SIG$1: forwarding it to the srun step (pid $MG_STEP_PID)"
        kill -s "$1" "$MG_STEP_PID" 2>/dev/null || true
    else
        mg_log "got SIG$1 before the srun step started"
    fi
}
trap 'mg_forward USR1' USR1
trap 'mg_forward TERM' TERM

mg_log "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $NNODES node(s) x $GPUS_PER_NODE," \
    "rendezvous $MASTER_ADDR:$MASTER_PORT, run dir $RUN_DIR, train args: ${MG_TRAIN_ARGS[*]}"

# Wait for the srun step started in the background (a trapped signal interrupts `wait`),
# then requeue after a USR1 warning, or exit with the step's status.
mg_wait_step() {
    MG_STEP_PID=$1
    if [[ -n "$MG_SIGNAL" ]]; then kill -s "$MG_SIGNAL" "$MG_STEP_PID" 2>/dev/null || true; fi
    local rc=0
    while kill -0 "$MG_STEP_PID" 2>/dev/null; do
        wait "$MG_STEP_PID" || true
    done
    wait "$MG_STEP_PID" || rc=$?
    if [[ "$MG_SIGNAL" == USR1 ]]; then
        if mg_run_complete; then
            mg_log "warning signal, but the run is complete: not requeueing"
            exit 0
        fi
        if ! mg_saved_since "$MG_SIGNAL_TIME"; then
            mg_log "warning signal, but no checkpoint was saved after it (step exit status" \
                "$rc; the pre-emption save failed or never ran): not requeueing; see the" \
                "log above, then resubmit (it resumes from the latest checkpoint)"
            exit $((rc != 0 ? rc : 1))
        fi
        if ((${SLURM_RESTART_COUNT:-0} >= MAX_REQUEUES)); then
            mg_log "warning signal handled, but job $SLURM_JOB_ID was already requeued" \
                "${SLURM_RESTART_COUNT:-0} times (MAX_REQUEUES=$MAX_REQUEUES): not requeueing;" \
                "resubmit or raise MAX_REQUEUES"
            exit 3
        fi
        mg_log "warning signal handled (step exit status $rc): requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    fi
    mg_log "srun step exited with status $rc"
    exit "$rc"
}
