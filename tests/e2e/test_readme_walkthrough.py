"""The README's "A first hour" block, run as written (issue 47): train, watch, evaluate,
convert and resume on the tiny model, each line a command in a scratch directory; and the
GPU block's `plan`, which needs no GPU. A README edit that breaks a command fails here."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def blocks() -> tuple[list[str], list[str]]:
    """The walk-through's command lines, and the GPU block's (the next bash block)."""
    text = (REPO / "README.md").read_text()
    tail = text[text.index("<!-- walkthrough -->") :]
    found = re.findall(r"```bash\n(.*?)```", tail, re.S)
    return found[0].strip().splitlines(), found[1].strip().splitlines()


def as_run_here(line: str) -> str:
    """The line with the project's CLI as this interpreter runs it and the repository's
    configs by path (the commands themselves unchanged)."""
    cli = f"{sys.executable} -m megatron_grpo.cli.main"
    line = re.sub(r"^(\.venv/bin/)?megatron-grpo ", cli + " ", line)
    return line.replace("configs/", f"{REPO}/configs/")


def sh(line: str, cwd: Path, timeout: int) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    proc = subprocess.Popen(["bash", "-c", as_run_here(line)], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:  # the whole session this test started: bash and its children
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out


@pytest.mark.timeout(1200)
def test_the_readme_walkthrough_runs_as_written(tmp_path):
    walk, gpu = blocks()
    assert len(walk) == 5 and all(w.strip() for w in walk)
    outs = []
    for line in walk:
        rc, out = sh(line, tmp_path, 400)
        assert rc == 0, f"{line}\n{out[-3000:]}"
        outs.append(out)
    run = tmp_path / "runs" / "walk"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == list(range(1, 13))  # trained 8, resumed to 12
    assert json.loads(outs[1])["step"] == 8  # watch: the last row after the first train
    assert "pass@1" in outs[2]
    assert (run / "hf" / "config.json").is_file() and (run / "hf" / "model.safetensors").is_file()
    assert "resumed from" in outs[4]
    plan = [line for line in gpu if " plan " in f" {line} "]
    assert len(plan) == 1
    rc, out = sh(plan[0], tmp_path, 120)
    assert rc == 0 and "GiB" in out, out[-3000:]
