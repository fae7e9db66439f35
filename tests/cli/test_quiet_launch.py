"""Issue 47 item 3: a refusal under a torchrun the project started itself (launchers/*.sh,
``train`` as one process) ends with the ranks' one line, not torchrun's ChildFailedError."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cpu_demo_refusal_is_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO),
           "RUN_DIR": str(tmp_path / "run")}  # fmt: skip
    out = subprocess.run(
        ["bash", "launchers/cpu_demo.sh", "grpo.group_size=-4"], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    lines = [x for x in (out.stdout + out.stderr).splitlines() if x.strip()]
    assert lines == ["error: grpo.group_size=-4 must be > 0."], out.stdout + out.stderr
    assert out.returncode == 2
    assert not (tmp_path / "run").exists()
