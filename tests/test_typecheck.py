"""mypy over the package is clean (pyproject.toml's [tool.mypy]: the default checks, strict on
policy/), so CI, which runs `make test`, holds the type checker as `make lint` does."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a cold run (CI's fresh clone) takes 20-40 s on 2 cores; cached, ~1 s
def test_mypy_is_clean():
    assert importlib.util.find_spec("mypy") is not None, (
        "mypy is not installed: it comes with the dev extra (pip install -e '.[dev]')."
    )
    run = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, (
        f"mypy found type errors (run `make lint` or `python -m mypy` to see them):\n"
        f"{run.stdout}{run.stderr}"
    )
