"""One command for a machine with a GPU: run tests/gpu and print every figure.

    python tests/gpu/run_gpu_suite.py [--out gpu_figures.json]

Needs torch (CUDA), megatron-core 0.16.1, transformers, pyyaml, numpy and pytest; no vLLM
(the loop test, tests/gpu/test_loop.py, runs ``GRPOTrainer.run()`` with the transformers
engine of tests/gpu/hf_engine.py behind the real bridge). Writes the figures as JSON
(default: $OUT/gpu_figures.json when $OUT is set, else ./gpu_figures.json) and the pytest
log next to it; exits with pytest's status. About 2 minutes on an H100 (docs/benchmarks.md
§4 has that run's figures).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = Path(os.environ["OUT"]) / "gpu_figures.json" if os.environ.get("OUT") else None
    ap.add_argument("--out", type=Path, default=default or Path("gpu_figures.json"))
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MGRPO_GPU_FIGURES=str(args.out.resolve()))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/gpu"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    log = args.out.with_suffix(".log")
    log.write_text(proc.stdout + proc.stderr)
    print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n")
    import torch

    info = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "suite_s": round(time.perf_counter() - t0, 1),
    }
    figures = json.loads(args.out.read_text()) if args.out.exists() else {}
    figures = {"_machine": info, **figures}
    args.out.write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    for k, v in figures.items():
        print(f"{k:48s} {v:.4g}" if isinstance(v, float) else f"{k:48s} {v}")
    print(f"figures: {args.out}  log: {log}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
