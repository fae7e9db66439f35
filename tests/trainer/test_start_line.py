"""Issue 47 item 11: the start line names an MoE model's experts and the layout's ep."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from megatron_grpo.config import load_config
from megatron_grpo.models.shapes import preset_spec
from megatron_grpo.trainer.build import run_line


def _line(preset: str, ep: int, cp: int = 1) -> str:
    ctx = SimpleNamespace(world_size=2, tp=1, cp=cp, pp=1, dp=2 // cp, ep=ep)
    return run_line(load_config(None, []), ctx, Path("hf"), preset_spec(preset), 1)  # type: ignore[arg-type]


def test_moe_line_names_experts_and_ep():
    line = _line("tiny-moe", 2)
    assert "tp=1 pp=1 dp=2 ep=2," in line and "4 experts top-2" in line


def test_dense_line_has_no_ep():
    line = _line("tiny", 1)
    assert "tp=1 pp=1 dp=2," in line and "ep=" not in line and "experts" not in line


def test_context_parallel_line_names_cp():
    """Issue 42: a run at parallel.cp=2 says so (its dp=1 alone would hide a rank)."""
    assert "tp=1 cp=2 pp=1 dp=1 ep=2," in _line("tiny-moe", 2, cp=2)
    assert "cp=" not in _line("tiny", 1)
