"""The GPU suite (tests/gpu): every test here needs a CUDA device and is skipped without one,
so CI (CPU) collects and skips it. ``MGRPO_GPU_SUITE_ON_CPU=1`` runs the parts that can run
on CPU (a self-check of the suite's own code on machines without a GPU; CUDA-only parts
still skip). ``MGRPO_GPU_FIGURES=path.json`` collects every measured figure into one JSON
(tests/gpu/run_gpu_suite.py sets it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ON_CPU = os.environ.get("MGRPO_GPU_SUITE_ON_CPU") == "1"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available() and not ON_CPU:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device (tests/gpu)"))


_FIGURES: dict[str, object] = {}


@pytest.fixture(scope="session")
def figures():
    """Measured figures by name; written to $MGRPO_GPU_FIGURES at the end of the session."""
    yield _FIGURES
    out = os.environ.get("MGRPO_GPU_FIGURES")
    if out:
        Path(out).write_text(json.dumps(_FIGURES, indent=2, sort_keys=True) + "\n")


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("CUDA-only part (MGRPO_GPU_SUITE_ON_CPU runs the rest)")


@pytest.fixture(scope="session")
def ctx():
    """A world-1 trainer context (nccl with CUDA, gloo otherwise) for the whole session."""
    from megatron_grpo.config.schema import ParallelConfig
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.models.shapes import preset_spec

    with distributed_context(ParallelConfig(), preset_spec("tiny"), seed=7) as c:
        yield c
