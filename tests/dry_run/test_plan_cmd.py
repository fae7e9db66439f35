"""``megatron-grpo plan``: JSON fields, placements, memory arithmetic, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_grpo.cli.main import main
from megatron_grpo.config import load_config
from megatron_grpo.distributed.placement import place_ranks
from megatron_grpo.dry_run import build_launch_plan
from megatron_grpo.dry_run.memory import GIB, trainer_params_per_rank
from megatron_grpo.models.shapes import resolve_spec

REPO = Path(__file__).resolve().parents[2]
CFG_7B = str(REPO / "configs" / "qwen2.5-7b-throughput.yaml")


def _plan_json(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "plan.json"
    assert (
        main(["plan", "--config", CFG_7B, "--preset", "Qwen2.5-7B", "--json", str(out), *args]) == 0
    )
    return json.loads(out.read_text())


def test_7b_one_node_colocated(tmp_path: Path, capsys) -> None:
    d = _plan_json(tmp_path, "--nodes", "1", "--gpus-per-node", "8")
    assert "memory per GPU (GiB)" in capsys.readouterr().out
    assert d["world_size"] == 8
    assert d["train_ranks"] == list(range(8)) and d["rollout_ranks"] == list(range(8))
    assert d["engines"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert d["parallel"] == {"tp": 2, "pp": 1, "cp": 1, "dp": 4, "vpp": None}
    mem = d["memory_per_gpu_bytes"]
    for key in ("params", "grads", "optimizer", "activations", "vllm_weights", "vllm_kv_cache"):
        assert mem[key] > 0, key
    assert mem["total"] <= 80 * GIB
    # bf16 params, fp32 grads, distributed optimizer: 12 bytes/param over dp=4
    assert mem["grads"] == 2 * mem["params"]
    assert mem["optimizer"] == 12 * (mem["params"] // 2) // 4
    assert mem["vllm_weights"] + mem["vllm_kv_cache"] == int(0.4 * 80 * GIB)
    # Two engines each receive the whole bf16 model once (norms replicated per TP rank).
    n = d["num_parameters"]
    assert 2 * 2 * n <= d["sync_bytes_per_sync"] < 2 * 2 * n * 1.01
    assert d["sync_bytes_per_sync"] == sum(d["sync_bytes_per_link"].values())
    assert d["sync_cross_node_bytes"] == 0


def test_7b_two_node_disaggregated(tmp_path: Path) -> None:
    d = _plan_json(
        tmp_path, "--nodes", "2", "--gpus-per-node", "8", "rollout.placement=disaggregated",
        "rollout.num_engines=2", "rollout.gpu_memory_utilization=0.9",
    )  # fmt: skip
    assert d["train_ranks"] == list(range(8)) and d["rollout_ranks"] == list(range(8, 16))
    assert d["parallel"]["dp"] == 4
    by_role = d["memory_by_role_bytes"]
    assert by_role["train"]["vllm_kv_cache"] == 0 and by_role["rollout"]["params"] == 0
    assert d["sync_cross_node_bytes"] == d["sync_bytes_per_sync"] == d["sync_cross_process_bytes"]
    # The training loop runs this placement: the plan no longer warns that it cannot.
    assert not any("colocated only" in w for w in d["warnings"])


def test_disaggregated_placement_puts_the_engines_on_the_last_ranks() -> None:
    cfg = load_config(
        None, ["rollout.placement=disaggregated", "rollout.num_engines=3", "rollout.tp=2"]
    )
    p = place_ranks(cfg.rollout, 16)
    assert p.train_ranks == list(range(10)) and p.rollout_ranks == list(range(10, 16))
    assert p.engines == [[10, 11], [12, 13], [14, 15]]


def test_trainer_params_per_rank_sums_to_model() -> None:
    spec, _ = resolve_spec("x", preset="Qwen2.5-7B")
    cfg = load_config(CFG_7B, ["parallel.tp=1"])
    # untied, TP=1, PP=1: the whole model plus Megatron's vocabulary padding rows
    padded_rows = (152064 + 127) // 128 * 128 - 152064
    assert trainer_params_per_rank(spec, cfg) == spec.num_parameters + 2 * padded_rows * 3584


def test_recompute_lowers_activations() -> None:
    spec, _ = resolve_spec("x", preset="Qwen2.5-7B")
    cfg = load_config(CFG_7B, ["grpo.batch.micro_batch_tokens=0"])  # the same tokens either way
    a = build_launch_plan(cfg, spec, nodes=1, gpus_per_node=8)
    b = build_launch_plan(cfg, spec, nodes=1, gpus_per_node=8, recompute=True)
    assert b.memory.peak.components["activations"] < a.memory.peak.components["activations"]
    # with the budget sized by memory (auto), recompute buys a larger micro-batch instead
    auto = load_config(CFG_7B)
    a = build_launch_plan(auto, spec, nodes=1, gpus_per_node=8)
    b = build_launch_plan(auto, spec, nodes=1, gpus_per_node=8, recompute=True)
    assert b.budget.tokens > a.budget.tokens and a.budget.bound == "memory"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--nodes", "1", "--gpus-per-node", "6"],
            "rollout.tp(4) does not divide the world size 6",
        ),
        (
            ["--nodes", "1", "--gpus-per-node", "8", "parallel.tp=3"],
            "tp(3)*pp(1)=3 does not divide",
        ),
        (["--nodes", "1", "--gpus-per-node", "8", "--gpu-memory-gb", "40"], "out of GPU memory"),
        (
            ["--nodes", "1", "--gpus-per-node", "8", "rollout.gpu_memory_utilization=0.04"],
            "vLLM cannot start",
        ),
        (
            ["--nodes", "2", "--gpus-per-node", "8", "rollout.placement=disaggregated"],
            "rollout.num_engines >= 1",
        ),
    ],
)
def test_impossible_plan_one_line(args: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["plan", "--config", CFG_7B, "--preset", "Qwen2.5-7B", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


@pytest.mark.slow
def test_impossible_plan_subprocess_no_traceback() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "megatron_grpo.cli.main", "plan", "--config", CFG_7B,
         "--nodes", "1", "--gpus-per-node", "8"],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.splitlines() == [out.stderr.strip()] and "Traceback" not in out.stderr
    assert "has no config.json" in out.stderr and "--preset" in out.stderr


def test_model_config_file(tmp_path: Path) -> None:
    from megatron_grpo.models.tiny import hf_config_dict

    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict("Qwen2.5-0.5B")))
    spec, source = resolve_spec("ignored", model_config=str(tmp_path))
    assert spec.hidden_size == 896 and source.endswith("config.json")
