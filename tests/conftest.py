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
