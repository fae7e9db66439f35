"""Every shipped config loads and validates; the demo config is the embedded default."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from megatron_grpo.config import load_config, save_config

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))


def test_configs_are_shipped():
    names = {p.name for p in CONFIGS}
    assert {
        "tiny_cpu.yaml",
        "qwen2.5-0.5b-gsm8k.yaml",
        "r1-distill-qwen-1.5b-deepscaler.yaml",
        "qwen2.5-7b-throughput.yaml",
    } <= names


def _only(got, value):
    """``got`` cut to the keys ``value`` sets, in sections and nested sections alike."""
    if isinstance(value, dict):
        return {k: _only(got[k], v) for k, v in value.items()}
    return got


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_validates_and_every_value_it_sets_takes_effect(path, tmp_path):
    cfg = load_config(path)  # raises ConfigError on an unknown key or an invalid value
    loaded = dataclasses.asdict(cfg)
    for key, value in yaml.safe_load(path.read_text()).items():
        assert _only(loaded[key], value) == value, (path.name, key)
    # The copy written into the run directory reloads to the same config.
    assert dataclasses.asdict(load_config(save_config(cfg, tmp_path))) == loaded


def test_tiny_cpu_is_the_embedded_default_on_two_ranks():
    default = dataclasses.asdict(load_config())
    tiny = dataclasses.asdict(load_config(CONFIGS[0].parent / "tiny_cpu.yaml"))
    diff = {(s, k) for s in default if isinstance(default[s], dict)
            for k in default[s] if default[s][k] != tiny[s][k]}  # fmt: skip
    assert diff == {("parallel", "tp")}
    assert default["model"]["hf_path"] == "tiny" and default["sync"]["interval"] > 1


def test_paper_configs_carry_the_papers_hyperparameters():
    q = load_config(CONFIGS[0].parent / "qwen2.5-0.5b-gsm8k.yaml")
    assert (q.grpo.group_size, q.optim.lr, q.grpo.kl.kl_coef, q.rollout.temperature) == (
        16, 5e-6, 0.1, 0.1)  # fmt: skip
    d = load_config(CONFIGS[0].parent / "r1-distill-qwen-1.5b-deepscaler.yaml")
    assert (d.grpo.group_size, d.optim.lr, d.grpo.kl.kl_coef, d.rollout.max_model_len) == (
        16, 1e-6, 0.001, 4096)  # fmt: skip
    for c in (q, d):  # the off-policy GRPO objective: E over all prompts, TRL's sequence mean
        assert (c.grpo.loss.loss_agg, c.grpo.loss.loss_normalizer) == ("seq_mean_token_mean", "all")
        assert c.grpo.zero_variance_mask and c.grpo.kl.kl_estimator == "k3"
        assert (
            c.grpo.off_policy.ratio_mode,
            c.grpo.loss.clip_eps_low,
            c.grpo.loss.clip_eps_high,
        ) == ("one", 0.2, 0.2)
    assert d.rollout.temperature == 0.7
    t = load_config(CONFIGS[0].parent / "qwen2.5-7b-throughput.yaml")
    assert (t.rollout.tp, t.rollout.placement, t.sync.interval) == (4, "colocated", 10)
