#!/usr/bin/env bash
# What a session lent one GPU runs, in one call (docs/benchmarks.md "What a GPU session should
# run"): `bench train` at 0.5B and 1.5B (project, hf, hf-packed), `bench ops` at 0.5B, then
# the GPU suite. The GPU machine has torch, transformers and Triton but no megatron-core: carry
# its wheel (and liger-kernel's, pyzmq's) in .whl/ (docs/benchmarks.md says how). Every figure
# goes to $OUT (or ./runs/bench/gpu when OUT is unset); each command has its own time limit so
# that one hang still leaves the others' figures.
#
#   bash tests/gpu/gpu_session.sh [train|ops|suite ...]     (default: all three)
set -u
cd "$(dirname "$0")/../.."
OUT="${OUT:-runs/bench/gpu}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
CLI=("$PY" -m megatron_grpo.cli.main)   # `timeout` runs a program, not a function
parts="${*:-train ops suite}"

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c 'import torch, transformers, megatron.core as m; print("torch", torch.__version__, "transformers", transformers.__version__, "megatron-core", m.__version__)'
    "$PY" -c 'import liger_kernel, importlib.metadata as md; print("liger-kernel", md.version("liger-kernel"))' 2>/dev/null || echo "liger-kernel: not installed"
    git log -1 --format='commit %h %s' 2>/dev/null || true
} | tee "$OUT/machine.txt"

for part in $parts; do
    case "$part" in
    train)
        timeout 140 "${CLI[@]}" bench train --preset Qwen2.5-0.5B --search off --json "$OUT/train_0.5b.json"
        timeout 160 "${CLI[@]}" bench train --preset Qwen2.5-1.5B --search off --json "$OUT/train_1.5b.json"
        ;;
    ops)
        # with the padding-free HF anchor (docs/benchmarks.md §7): its kernel launches too
        timeout 200 "${CLI[@]}" bench ops --preset Qwen2.5-0.5B --rows 32 --packs 5 --prompt-len 256 \
            --max-len 1024 --sides project,hf-packed --json "$OUT/ops_0.5b.json"
        ;;
    suite)
        timeout 300 "$PY" tests/gpu/run_gpu_suite.py --out "$OUT/gpu_figures.json"
        ;;
    *) echo "gpu_session.sh: unknown part '$part' (train, ops, suite)"; exit 2 ;;
    esac
done
