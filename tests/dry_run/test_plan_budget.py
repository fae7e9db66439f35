"""The packed micro-batch's token budget (``grpo.batch.micro_batch_tokens``, dry_run/budget.py):
``auto`` sized by the memory model on a GPU, explicit values kept, ``auto`` without a GPU the
budget of before (CPU runs and their golden numbers unchanged), a budget below one sequence
refused in one line, and ``plan`` printing the budget it would use and what bounds it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_grpo.cli.main import main
from megatron_grpo.config import ConfigError, load_config
from megatron_grpo.dry_run import build_launch_plan
from megatron_grpo.dry_run.budget import (
    BUDGET_MULTIPLE,
    MEMORY_FRACTION,
    PIPELINE_MICRO_BATCHES,
    resolve_token_budget,
)
from megatron_grpo.dry_run.memory import GIB, activation_bytes
from megatron_grpo.models.spec import spec_from_hf_config
from megatron_grpo.models.tiny import hf_config_dict
from megatron_grpo.policy.micro_batches import micro_batch_token_budget

REPO = Path(__file__).resolve().parents[2]
CFG_1P5B = REPO / "configs" / "r1-distill-qwen-1.5b-deepscaler.yaml"
SPEC_0P5B = spec_from_hf_config(hf_config_dict("Qwen2.5-0.5B"))
SPEC_1P5B = spec_from_hf_config(hf_config_dict("Qwen2.5-1.5B"))
LONG_32K = ["data.max_prompt_tokens=512", "rollout.max_new_tokens=32256",
            "rollout.max_model_len=32768"]  # fmt: skip


def _cfg(*overrides: str):
    base = ["grpo.batch.prompts_per_step=8", "grpo.group_size=8", "data.max_prompt_tokens=256",
            "rollout.max_new_tokens=768", "rollout.max_model_len=1024"]  # fmt: skip
    return load_config(None, [*base, *overrides])


def _budget(cfg, gib: float, spec=SPEC_0P5B, dp: int = 1):
    return resolve_token_budget(spec, cfg, dp=dp, colocated=True, capacity_bytes=int(gib * GIB))


def test_auto_budget_grows_with_memory_and_holds_one_sequence():
    cfg = _cfg()
    budgets = [_budget(cfg, gib) for gib in (8, 12, 16, 20, 24, 32, 48, 80)]
    tokens = [b.tokens for b in budgets]
    assert tokens == sorted(tokens) and len(set(tokens)) > 3, tokens
    assert all(t >= 1024 for t in tokens)  # a sequence never splits
    assert budgets[0].bound == "sequence"  # 8 GiB: not even one sequence in the model's 90%
    bounded = [b for b in budgets if b.bound == "memory"]
    assert bounded and all(b.tokens % BUDGET_MULTIPLE == 0 for b in bounded)
    assert budgets[-1].bound == "batch" and budgets[-1].tokens == 64 * 1024  # the whole step


def test_auto_budget_is_the_largest_multiple_that_fits():
    cfg, capacity = _cfg(), 24 * GIB
    b = _budget(cfg, 24)
    assert b.bound == "memory"
    train = build_launch_plan(cfg, SPEC_0P5B, nodes=1, gpus_per_node=1, gpu_memory_gb=24)
    assert train.budget == b
    phase = train.memory.peak.phases["train"]
    act = train.memory.peak.components["activations"]
    room = int(MEMORY_FRACTION * capacity) - (phase - act)
    assert act == activation_bytes(SPEC_0P5B, cfg, 1, False, b.tokens) <= room
    assert activation_bytes(SPEC_0P5B, cfg, 1, False, b.tokens + BUDGET_MULTIPLE) > room


def test_auto_budget_per_data_parallel_rank_and_pipeline():
    assert _budget(_cfg(), 200, dp=4).tokens == 16 * 1024  # a quarter of the step per rank
    piped = _budget(_cfg("parallel.pp=2"), 200)
    assert piped.bound == "pipeline" and piped.tokens == 64 * 1024 // (PIPELINE_MICRO_BATCHES * 2)


def test_explicit_and_cpu_budgets_are_as_configured():
    cfg = _cfg("grpo.batch.micro_batch_tokens=3000")
    assert _budget(cfg, 80).tokens == 3000 and _budget(cfg, 80).bound == "config"
    zero = _cfg("grpo.batch.micro_batch_tokens=0", "grpo.batch.micro_batch_size=4")
    assert _budget(zero, 80).tokens == 4 * 1024
    # auto without a GPU: micro_batch_size full sequences, the budget CPU runs always had
    auto = _cfg("grpo.batch.micro_batch_size=4")
    cpu = resolve_token_budget(None, auto, dp=1, colocated=True, capacity_bytes=None)
    assert cpu.tokens == micro_batch_token_budget(auto) == 4 * 1024
    assert "auto without a GPU" in cpu.line()
    padded = _budget(_cfg("grpo.batch.pack_sequences=false"), 80)
    assert padded.tokens is None and "padded" in padded.line()


def test_trainer_on_cpu_resolves_auto_as_before():
    from megatron_grpo.trainer.build import gpu_token_budget

    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml")
    ctx = SimpleNamespace(device=torch.device("cpu"), dp=1)
    assert gpu_token_budget(None, cfg, ctx).tokens == 64 * 80 == micro_batch_token_budget(cfg)


@pytest.mark.parametrize(
    "value, message",
    [
        ("1000", "grpo.batch.micro_batch_tokens=1000 is smaller than the longest sequence, "
                 "data.max_prompt_tokens(256) + rollout.max_new_tokens(768) = 1024, which never "
                 "splits: set grpo.batch.micro_batch_tokens >= 1024, or auto."),
        ("-2", "grpo.batch.micro_batch_tokens=-2 must be 'auto'"),
        ("lots", "grpo.batch.micro_batch_tokens='lots' must be 'auto'"),
    ],
)  # fmt: skip
def test_bad_budgets_are_one_line(value, message):
    with pytest.raises(ConfigError) as e:
        _cfg(f"grpo.batch.micro_batch_tokens={value}")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_small_budget_is_not_read_without_packing():
    assert (
        _cfg(
            "grpo.batch.micro_batch_tokens=1000", "grpo.batch.pack_sequences=false"
        ).grpo.batch.pack_sequences
        is False
    )


def test_plan_prints_the_budget(tmp_path: Path, capsys):
    out = tmp_path / "plan.json"
    args = ["plan", "--config", str(CFG_1P5B), "--preset", "Qwen2.5-1.5B", "--nodes", "1",
            "--gpus-per-node", "1", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    text, d = capsys.readouterr().out, json.loads(out.read_text())
    line = next(x for x in text.splitlines() if x.startswith("micro-batch  "))
    assert f"{d['micro_batch_tokens']:,} tokens each (auto, bounded by memory" in line, line
    assert "GiB left in the train phase by 90% of the 80 GiB GPU" in line
    assert d["micro_batch_tokens_bound"] == "memory" and d["micro_batch_tokens"] % 256 == 0
    assert main([*args, "grpo.batch.micro_batch_tokens=8192"]) == 0
    assert json.loads(out.read_text())["micro_batch_tokens"] == 8192


def test_32k_sequences_at_1p5b_on_one_80_gib_gpu():
    """Issue 31's goal, as the plan sees it (docs/benchmarks.md §6): one 32,768-token sequence
    of the 1.5B shape trains on one 80 GiB GPU with full recompute, many per micro-batch with
    the fused scoring; without recompute one sequence's activations (48.9 GiB) do not fit
    next to the deepscaler config's state."""
    cfg = load_config(CFG_1P5B, [*LONG_32K, "model.recompute=full"])
    plan = build_launch_plan(cfg, SPEC_1P5B, nodes=1, gpus_per_node=1)
    assert plan.budget.bound == "memory" and plan.budget.tokens >= 7 * 32768
    assert plan.memory.peak.total <= 80 * GIB
    with pytest.raises(ConfigError, match="out of GPU memory.*set model.recompute=full"):
        build_launch_plan(load_config(CFG_1P5B, LONG_32K), SPEC_1P5B, nodes=1, gpus_per_node=1)
