"""Fixtures shared by several test modules."""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import subprocess

import pytest


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """An HF directory of the ``tiny`` preset (seed 0), built once per test module."""
    from megatron_grpo.models.tiny import build_hf_model

    d = tmp_path_factory.mktemp("tiny") / "tiny"
    build_hf_model(d, "tiny", seed=0)
    return str(d)


def tiny_variant_dirs(tmp_path_factory, prefix: str, variants: dict[str, dict]) -> dict[str, str]:
    """An HF directory of the ``tiny`` preset (seed 3) per variant: name -> its overrides of
    the preset's shape (``models.tiny.build_hf_model``)."""
    from megatron_grpo.models.tiny import build_hf_model

    root = tmp_path_factory.mktemp(prefix)
    dirs = {}
    for name, overrides in variants.items():
        d = root / name
        build_hf_model(d, "tiny", seed=3, **overrides)
        dirs[name] = str(d)
    return dirs


# The fast lane (`make test-fast`: -m "not slow") stays fast only if every test that starts a
# process carries the `slow` mark. A test without it that starts a Python interpreter,
# torchrun, a shell script or a multiprocessing process fails, naming what it started;
# system tools (ldconfig, which libraries run; mount; git; shellcheck) do not count.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _costly(argv0: str) -> bool:
    name = os.path.basename(argv0)
    return (
        name.startswith("python")
        or name in ("torchrun", "bash", "sh", "sbatch", "srun")
        or name.endswith((".sh", ".sbatch"))
        or (os.sep in argv0 and os.path.abspath(argv0).startswith(_REPO + os.sep))
    )


class SpawnInFastTest(AssertionError):
    pass


def _refuse_spawn(nodeid: str, what: str):
    raise SpawnInFastTest(
        f"{nodeid} starts a process ({what}) but is not marked slow: add "
        "@pytest.mark.slow (pyproject.toml's marker) or keep the work in the test process."
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _spawns_refused(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _spawns_refused(item):
        yield


@contextlib.contextmanager
def _spawns_refused(item):
    """Around a test not marked slow (its fixtures too): subprocess.Popen and
    multiprocessing's Process.start (spawn_ranks, vLLM's engine core, process pools) raise."""
    if item.get_closest_marker("slow") is not None:
        yield
        return
    popen_init, start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def checked_popen(self, args, *a, **k):
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        if _costly(str(argv[0]).split()[0]):
            _refuse_spawn(item.nodeid, " ".join(map(str, argv)).replace("\n", " ")[:200])
        popen_init(self, args, *a, **k)

    def checked_start(self):
        _refuse_spawn(item.nodeid, f"multiprocessing {self.name}")

    subprocess.Popen.__init__ = checked_popen
    multiprocessing.process.BaseProcess.start = checked_start
    try:
        yield
    finally:
        subprocess.Popen.__init__ = popen_init
        multiprocessing.process.BaseProcess.start = start


@pytest.fixture(scope="module")
def tiny_moe_dirs(tmp_path_factory) -> dict[str, str]:
    """The tiny MoE preset in each of its variants (tests/helpers/layouts.py MOE_VARIANTS),
    as HF checkpoints: variant name -> directory."""
    from megatron_grpo.models.tiny import build_hf_model
    from tests.helpers.layouts import MOE_VARIANTS

    root = tmp_path_factory.mktemp("moe")
    return {
        name: str(build_hf_model(root / name, "tiny-moe", seed=3, **overrides))
        for name, overrides in MOE_VARIANTS.items()
    }
