"""The old flat ``grpo`` keys of the last release (issue 44's split of ``grpo`` into
``batch``, ``loss``, ``kl`` and ``off_policy``) still load, each with one notice line."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from megatron_grpo.config import DEPRECATED, Config, ConfigError, load_config, save_config
from megatron_grpo.config.deprecated import REMOVED_IN, SHOWN_VAR


def _field(cls: type, dotted: str) -> dataclasses.Field | None:
    """The dataclass field ``dotted`` names below ``cls``, or None."""
    head, _, rest = dotted.partition(".")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if head not in fields:
        return None
    if not rest:
        return fields[head]
    sub = fields[head].default_factory
    return _field(sub, rest) if dataclasses.is_dataclass(sub) else None  # type: ignore[arg-type]


def _notice(old: str) -> str:
    return (
        f"{old} is deprecated: use {DEPRECATED[old]} (the old key is accepted until {REMOVED_IN})"
    )


def test_every_old_key_names_a_field_of_the_tree_and_is_gone_from_it():
    assert len(DEPRECATED) == 28
    for old, new in DEPRECATED.items():
        assert _field(Config, new) is not None, new
        assert _field(Config, old) is None, old  # else the old key would shadow nothing
        assert old.rsplit(".", 1)[1] == new.rsplit(".", 1)[1]  # a key only gains its section
    grpo = Config().grpo
    moved = {f"grpo.{s}.{f.name}" for s in ("batch", "loss", "kl", "off_policy")
             for f in dataclasses.fields(getattr(grpo, s))}  # fmt: skip
    assert moved == set(DEPRECATED.values())  # every moved key has its old name


@pytest.mark.parametrize(
    "old, value",
    [("grpo.clip_eps_low", "0.3"), ("grpo.kl_coef", "0.05"), ("grpo.prompts_per_step", "4"),
     ("grpo.score_alpha", "true"), ("grpo.policy_loss", "rec")],
)  # fmt: skip
def test_an_old_key_gives_one_notice_and_the_new_keys_config(old, value, capsys):
    new = load_config(overrides=[f"{DEPRECATED[old]}={value}"])
    assert capsys.readouterr().err == ""
    got = load_config(overrides=[f"{old}={value}"])
    assert capsys.readouterr().err.splitlines() == [_notice(old)]
    assert dataclasses.asdict(got) == dataclasses.asdict(new)


@pytest.mark.parametrize("old", sorted(DEPRECATED))
def test_every_old_key_is_accepted_at_its_default(old, capsys):
    section, key = DEPRECATED[old].split(".")[1:]
    default = getattr(getattr(Config().grpo, section), key)
    cfg = load_config(overrides=[f"{old}={'null' if default is None else default}"])
    assert capsys.readouterr().err.splitlines() == [_notice(old)]
    assert dataclasses.asdict(cfg) == dataclasses.asdict(Config())


def test_old_and_new_key_that_disagree_is_one_line_naming_both():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["grpo.clip_eps_low=0.3", "grpo.loss.clip_eps_low=0.25"])
    msg = str(e.value)
    assert "\n" not in msg and "grpo.clip_eps_low=0.3" in msg
    assert "grpo.loss.clip_eps_low=0.25" in msg and "keep only grpo.loss.clip_eps_low" in msg
    # the same value twice is no conflict
    assert load_config(overrides=["grpo.kl_coef=0.1", "grpo.kl.kl_coef=0.1"]).grpo.kl.kl_coef == 0.1


def test_unknown_keys_in_a_new_section_still_list_its_keys():
    with pytest.raises(ConfigError, match=r"unknown config key 'grpo.loss.nope': grpo.loss has "
                                          r"\['policy_loss', 'clip_eps_low'"):  # fmt: skip
        load_config(overrides=["grpo.loss.nope=1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'grpo.nope': grpo has "):
        load_config(overrides=["grpo.nope=1"])


def test_a_run_dirs_old_flat_config_yaml_loads(tmp_path, capsys):
    """A run directory written before the split (``train --resume`` on it, eval's
    ``config.yaml``) loads to the same config, one notice per old key."""
    cfg = load_config(overrides=["grpo.loss.clip_eps_high=0.28", "grpo.kl.kl_coef=0.01",
                                 "grpo.batch.prompts_per_step=4"])  # fmt: skip
    tree = dataclasses.asdict(cfg)
    flat = dict(tree["grpo"])
    for section in ("batch", "loss", "kl", "off_policy"):
        flat.update(flat.pop(section))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({**tree, "grpo": flat}, sort_keys=False))
    capsys.readouterr()
    old = load_config(tmp_path / "config.yaml")
    assert sorted(capsys.readouterr().err.splitlines()) == sorted(map(_notice, DEPRECATED))
    assert dataclasses.asdict(old) == tree
    # what a run writes now is the nested shape, and reloads without a notice
    written = yaml.safe_load(save_config(old, tmp_path / "new").read_text())
    assert set(written["grpo"]) >= {"batch", "loss", "kl", "off_policy"}
    assert dataclasses.asdict(load_config(tmp_path / "new" / "config.yaml")) == tree
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("env", [{"RANK": "1"}, {SHOWN_VAR: "1"}])
def test_the_notice_is_printed_once_per_launch(env, monkeypatch, capsys):
    """Rank 0 prints it, and the ranks a one-process ``train`` starts do not print it again
    (distributed/spawn.py ``run_under_torchrun`` sets SHOWN_VAR in their environment)."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert load_config(overrides=["grpo.kl_coef=0.1"]).grpo.kl.kl_coef == 0.1
    assert capsys.readouterr().err == ""
