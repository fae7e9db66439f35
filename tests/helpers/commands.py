"""Run ``megatron-grpo`` and a plain vLLM reference as subprocesses (vLLM state stays
out of the test process); every process started here is waited for or killed by its own handle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# Plain vLLM on an HF directory: greedy responses and prompt logprobs (the reference).
VLLM_REF = r"""
import json, os, sys

def main():
    from vllm import LLM, SamplingParams
    hf, prompts_file, out = sys.argv[1:4]
    req = json.loads(open(prompts_file).read())
    llm = LLM(model=hf, dtype="float32", enforce_eager=True, max_model_len=128,
              kv_cache_memory_bytes=2**28, seed=0)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=req["max_new_tokens"],
                            stop_token_ids=[req["eos"]])
        outs = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]], sp,
                            use_tqdm=False)
        result = {"responses": [list(o.outputs[0].token_ids) for o in outs]}
        seqs = req.get("logprob_seqs") or []
        if seqs:
            lp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
            res = llm.generate([{"prompt_token_ids": s} for s in seqs], lp, use_tqdm=False)
            result["prompt_logprobs"] = [
                [d[t].logprob for d, t in zip(r.prompt_logprobs[1:], s[1:])]
                for r, s in zip(res, seqs)
            ]
    finally:
        # Stop the engine-core process now, as RolloutEngine.shutdown does: os._exit below
        # skips vLLM's atexit finalizers, so nothing else would stop it.
        llm.llm_engine.engine_core.shutdown()
    with open(out, "w") as f:
        f.write(json.dumps(result))
    # Then leave without the interpreter's teardown: left to it, the process at times
    # aborts after the engine has stopped cleanly ("terminate called without an active
    # exception", exit -6: a C++ thread destroyed while still joinable), which failed a CI
    # run on the exit code alone; rare (none in 12 runs on a 2-core machine).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

if __name__ == "__main__":
    main()
"""


def run(cmd: list[str], timeout: int) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out


def cli(*args: str, timeout: int = 300) -> tuple[int, str]:
    return run([sys.executable, "-m", "megatron_grpo.cli.main", *args], timeout)


def vllm_reference(hf: Path, prompts: list[list[int]], eos: int, max_new_tokens: int,
                   tmp: Path, logprob_seqs: list[list[int]] | None = None) -> dict:  # fmt: skip
    script, req, out = tmp / "vllm_ref.py", tmp / "ref_req.json", tmp / "ref_out.json"
    script.write_text(VLLM_REF)
    req.write_text(json.dumps({"prompts": prompts, "eos": eos, "max_new_tokens": max_new_tokens,
                               "logprob_seqs": logprob_seqs or []}))  # fmt: skip
    rc, log = run([sys.executable, str(script), str(hf), str(req), str(out)], 300)
    assert rc == 0, f"rc={rc}\n{log[-3000:]}"
    return json.loads(out.read_text())


def read_dump(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
