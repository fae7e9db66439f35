"""The GPU extra's pip resolver dry run (test_gpu_install.py's slow test) starts in the
background as soon as collection has selected that test, and the test reads its result.
The dry run waits on PyPI for about 3 minutes at ~15% of one core (measured: 191 s wall,
31 s CPU), so in a whole-suite run it overlaps the CPU-bound tests collected before it
instead of running alone. It is the same command (``python -m
megatron_grpo.platform.gpu_install``): isolated from this machine's pip config, a dry run
that installs nothing and writes only its JSON, in its own session; it shares no state
with the tests beside it. Whatever the session's outcome, it is killed at its end if still
running, by the process group this file started."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

DRY_RUN_TEST = "test_gpu_install.py::test_gpu_extra_resolves_for_linux_x86_64_py312"
REPO = Path(__file__).resolve().parents[2]


class BackgroundDryRun:
    """``python -m megatron_grpo.platform.gpu_install --json OUT`` started now."""

    def __init__(self, python_version: str = "3.12") -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gpu-dry-run-"))
        self.json = self.dir / "result.json"
        self.log = self.dir / "output.log"
        with open(self.log, "w") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "megatron_grpo.platform.gpu_install",
                 "--python-version", python_version, "--json", str(self.json)],
                stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
            )  # fmt: skip

    def result(self, timeout_s: float) -> dict[str, Any]:
        """The JSON it wrote: the resolution, or ``{"error", "unreachable"}``."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"the pip dry run ran past {timeout_s:.0f}s") from None
        if not self.json.is_file():
            raise AssertionError(f"the pip dry run wrote no result: {self.log.read_text()[-2000:]}")
        return json.loads(self.json.read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


_started: list[BackgroundDryRun] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    if any(item.nodeid.endswith(DRY_RUN_TEST) for item in session.items):
        _started.append(BackgroundDryRun())


def pytest_sessionfinish(session: pytest.Session) -> None:
    while _started:
        run = _started.pop()
        run.stop()
        shutil.rmtree(run.dir, ignore_errors=True)


@pytest.fixture
def gpu_dry_run() -> BackgroundDryRun:
    """The dry run started at collection (one is started here if none was)."""
    if not _started:
        _started.append(BackgroundDryRun())
    return _started[0]
