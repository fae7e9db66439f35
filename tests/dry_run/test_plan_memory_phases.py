"""``megatron-grpo plan`` models the colocated loop's memory dance (trainer/colocated_memory.py): every
shipped GPU config fits an 80 GiB GPU with the loop's real behaviour, the phases move by
exactly what the offload and sleep keys move, and a config that would not fit is refused
with one line (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_grpo.cli.main import main
from megatron_grpo.config import load_config
from megatron_grpo.dry_run import build_launch_plan
from megatron_grpo.dry_run.memory import GIB, RUNTIME_OVERHEAD_BYTES
from megatron_grpo.models.spec import spec_from_hf_config
from megatron_grpo.models.tiny import hf_config_dict

REPO = Path(__file__).resolve().parents[2]


def _r1_distill_1p5b():
    # DeepSeek-R1-Distill-Qwen-1.5B's config.json: the Qwen2.5-1.5B shape, untied embeddings.
    return spec_from_hf_config({**hf_config_dict("Qwen2.5-1.5B"), "tie_word_embeddings": False})


SHAPES = {
    "qwen2.5-0.5b-gsm8k.yaml": lambda: spec_from_hf_config(hf_config_dict("Qwen2.5-0.5B")),
    "qwen2.5-0.5b-gsm8k-calculator.yaml": lambda: spec_from_hf_config(
        hf_config_dict("Qwen2.5-0.5B")
    ),
    "r1-distill-qwen-1.5b-deepscaler.yaml": _r1_distill_1p5b,
    "r1-distill-qwen-1.5b-deepscaler-64k.yaml": _r1_distill_1p5b,
    "qwen2.5-7b-throughput.yaml": lambda: spec_from_hf_config(hf_config_dict("Qwen2.5-7B")),
}


def test_every_shipped_gpu_config_is_covered():
    shipped = {p.name for p in (REPO / "configs").glob("*.yaml")} - {
        "tiny_cpu.yaml",
        "tiny_moe_cpu.yaml",
        "tiny_tools_cpu.yaml",
    }
    assert shipped == set(SHAPES), "add the new config's model shape to SHAPES"


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shipped_config_fits_80_gib_one_node(name):
    cfg = load_config(REPO / "configs" / name)
    plan = build_launch_plan(cfg, SHAPES[name](), nodes=1, gpus_per_node=8, gpu_memory_gb=80)
    peak = plan.memory.peak
    assert set(peak.phases) == {"generate", "train", "sync", "checkpoint"}
    assert peak.total == max(peak.phases.values()) <= 80 * GIB


def test_phases_move_by_what_the_keys_move():
    spec = SHAPES["qwen2.5-7b-throughput.yaml"]()
    cfg_path = REPO / "configs" / "qwen2.5-7b-throughput.yaml"

    def phases(*overrides):  # at one token budget (auto would resize it with the memory left)
        cfg = load_config(cfg_path, ["grpo.batch.micro_batch_tokens=0", *overrides])
        plan = build_launch_plan(cfg, spec, nodes=1, gpus_per_node=8)
        return plan.memory.peak.phases, plan.memory.peak.components

    none, c = phases("rollout.trainer_offload=none")
    opt, _ = phases()  # trainer_offload=optimizer (default)
    full, _ = phases("rollout.trainer_offload=all")
    awake, _ = phases("rollout.sleep_between_rollouts=false", "rollout.gpu_memory_utilization=0.2")
    state = sum(c[k] for k in ("params", "grads", "optimizer", "reference", "served"))
    reserved = c["vllm_weights"] + c["vllm_kv_cache"]
    assert none["generate"] == state + reserved + RUNTIME_OVERHEAD_BYTES
    assert none["generate"] - opt["generate"] == c["grads"] + c["optimizer"]
    assert opt["generate"] - full["generate"] == c["params"]
    assert opt["train"] == state + c["activations"] + RUNTIME_OVERHEAD_BYTES
    assert opt["sync"] == state - c["grads"] - c["optimizer"] + c["vllm_weights"] + (
        RUNTIME_OVERHEAD_BYTES
    )
    assert opt["checkpoint"] == state + c["vllm_weights"] + RUNTIME_OVERHEAD_BYTES
    # Without sleep vLLM's whole reservation (0.2 x 80 GiB here) stays through training.
    assert awake["train"] == opt["train"] + int(0.2 * 80 * GIB)


@pytest.mark.parametrize(
    "config, preset",
    [
        ("qwen2.5-7b-throughput.yaml", "Qwen2.5-7B"),
        ("r1-distill-qwen-1.5b-deepscaler.yaml", "Qwen2.5-1.5B"),
    ],
)
def test_no_sleep_does_not_fit_and_is_refused(config, preset, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--config", str(REPO / "configs" / config), "--preset", preset,
              "--nodes", "1", "--gpus-per-node", "8", "rollout.sleep_between_rollouts=false",
              # the logits path: with the fused scoring the 1.5B plan fits (76.5 of 80 GiB);
              # micro_batch_size full sequences: auto shrinks the budget to one and 7B fits
              "model.logprob_impl=logits", "grpo.batch.micro_batch_tokens=0"])  # fmt: skip
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "out of GPU memory" in err and "train phase" in err, err
    assert "rollout.sleep_between_rollouts=true" in err
