"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """An HF directory of the ``tiny`` preset (seed 0), built once per test module."""
    from megatron_grpo.models.tiny import build_hf_model

    d = tmp_path_factory.mktemp("tiny") / "tiny"
    build_hf_model(d, "tiny", seed=0)
    return str(d)
