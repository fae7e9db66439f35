"""The config tree: loading, overrides, validation messages, and the written run config."""

import dataclasses

import pytest
import yaml

from megatron_grpo.config import Config, ConfigError, load_config, parse_overrides, save_config


def test_defaults_validate_and_round_trip(tmp_path):
    cfg = load_config()
    assert isinstance(cfg, Config)
    path = save_config(cfg, tmp_path)
    again = load_config(path)
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)


def test_overrides_are_typed():
    cfg = load_config(
        overrides=["grpo.group_size=16", "optim.lr=3e-6", "parallel.vpp=null", "sync.verify=true"]
    )
    assert cfg.grpo.group_size == 16 and isinstance(cfg.grpo.group_size, int)
    assert cfg.optim.lr == pytest.approx(3e-6)
    assert cfg.parallel.vpp is None
    assert cfg.sync.verify is True


def test_yaml_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"steps": 7, "sync": {"interval": 3}, "grpo": {"group_size": 4}}))
    cfg = load_config(f, ["sync.interval=5"])
    assert (cfg.steps, cfg.sync.interval, cfg.grpo.group_size) == (7, 5, 4)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (
            ["grpo.group_sise=4"],
            "unknown config key 'grpo.group_sise': did you mean 'grpo.group_size'?",
        ),
        (["nosuch.x=1"], "unknown config key 'nosuch'"),
        (["grpo.group_size=four"], "grpo.group_size='four' is not an integer"),
        (["grpo.group_size=1"], "set grpo.group_size >= 2"),
        (["sync.interval=0"], "sync.interval=0 must be > 0"),
        (["sync.method=nccl"], "sync.method='nccl' is not one of ['direct', 'baseline']"),
        (["parallel.vpp=2"], "parallel.vpp=2 needs parallel.pp >= 2 (got 1)"),
        (
            ["parallel.sequence_parallel=true"],
            "parallel.sequence_parallel=true needs parallel.tp > 1",
        ),
        (
            ["grpo.off_policy.tis=token_truncate"],
            "set grpo.off_policy.ratio_mode=exact, grpo.off_policy.score_alpha=true or grpo.off_policy.tis=none",
        ),
        (["grpo.loss.dual_clip_c=0.5"], "grpo.loss.dual_clip_c=0.5 must be > 1"),
        (["optim.min_lr=1", "optim.lr=0.1"], "optim.min_lr=1.0 exceeds optim.lr=0.1"),
        (["grpo.batch.mini_batch_size=5"], "is not a multiple of grpo.batch.mini_batch_size(5)"),
        (["rollout.max_model_len=32"], "exceeds rollout.max_model_len(32)"),
        (["sync.verify=maybe"], "sync.verify='maybe' is not a boolean"),
        (["grpo.group_size"], "is not key=value"),
        (["rollout.top_p=0.9"], "rollout.top_p=0.9, rollout.top_k=-1: truncated sampling"),
        (["rollout.top_k=20"], "rollout.top_p=1.0, rollout.top_k=20: truncated sampling"),
        (["rollout.temperature=0"], "rollout.temperature=0.0 must be > 0"),
        (["grpo.loss.policy_loss=gspo"], "set grpo.loss.loss_agg=seq_mean_token_mean"),
        (["grpo.loss.loss_normalizer=some"], "grpo.loss.loss_normalizer='some' is not one of"),
        (["grpo.overlong_buffer=17"], "grpo.overlong_buffer(17) exceeds rollout.max_new_tokens"),
    ],
)
def test_validation_messages_name_value_and_fix(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    assert fragment in str(err.value)


def test_an_unknown_key_names_the_close_ones_not_its_whole_section(tmp_path):
    """A typo gets the key it is close to (difflib), in a YAML file too; the section's
    list only when nothing is close."""
    f = tmp_path / "c.yaml"
    f.write_text("grpo:\n  batch:\n    prompt_per_step: 4\n")
    with pytest.raises(ConfigError) as err:
        load_config(f)
    assert str(err.value) == (
        "unknown config key 'grpo.batch.prompt_per_step': did you mean "
        "'grpo.batch.prompts_per_step'?"
    )
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["grpo.loss.clip_eps=0.2"])
    assert "'grpo.loss.clip_eps_low' or 'grpo.loss.clip_eps_high'" in str(err.value)
    assert "policy_loss" not in str(err.value)  # not the section's other keys
    with pytest.raises(ConfigError, match=r"'logging.nope': logging has \['tensorboard'"):
        load_config(overrides=["logging.nope=1"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1, 2\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(bad)


def test_parse_overrides_nesting():
    assert parse_overrides(["a.b.c=1", "a.d=x"]) == {"a": {"b": {"c": 1}, "d": "x"}}
