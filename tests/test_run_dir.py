"""The run directory before a run starts (trainer/run_dir.py) and the prepared model's
recipe (models/prepare.py): nothing a failed or earlier run left is trusted blindly."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from megatron_grpo.checkpoint import LoopState, save_checkpoint
from megatron_grpo.config import ConfigError, load_config
from megatron_grpo.models.prepare import COMPLETE, prepare_model_dir
from megatron_grpo.trainer.run_dir import prepare_run_dir
from tests._eval_helpers import cli


def test_a_finished_run_is_refused_unless_resume_or_overwrite(tmp_path):
    run = tmp_path / "run"
    prepare_run_dir(run, resume=False, overwrite=False)  # missing: fine (created later)
    (run / "hf_model").mkdir(parents=True)
    prepare_run_dir(run, resume=False, overwrite=False)  # a failed start's model: not a run
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    save_checkpoint(run, LoopState(step=8), save_rng=False)
    with pytest.raises(ConfigError, match=r"already holds a run \(checkpoints, metrics.jsonl\): "
                       "continue it with --resume, replace it with --overwrite"):  # fmt: skip
        prepare_run_dir(run, resume=False, overwrite=False)
    prepare_run_dir(run, resume=True, overwrite=False)
    with pytest.raises(ConfigError, match="contradict"):
        prepare_run_dir(run, resume=True, overwrite=True)
    prepare_run_dir(run, resume=False, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == ["hf_model"]
    with pytest.raises(ConfigError, match="--resume: no complete checkpoint under"):
        prepare_run_dir(run, resume=True, overwrite=False)


def test_unusable_run_dirs_are_one_line(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        prepare_run_dir(f, resume=False, overwrite=False)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as root: permissions are not enforced")
        with pytest.raises(ConfigError, match="is not writable"):
            prepare_run_dir(ro / "run", resume=False, overwrite=False)
    finally:
        ro.chmod(0o700)


@pytest.mark.timeout(120)
def test_train_refuses_a_used_run_dir_before_building_anything(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text("{}")
    rc, out = cli("train", "--run-dir", str(run), "--steps", "1", timeout=100)
    assert rc == 2, out[-2000:]
    assert out.strip().splitlines() == [
        f"error: run_dir={str(run)!r} already holds a run (summary.json): continue it with "
        "--resume, replace it with --overwrite, or pass another --run-dir."
    ]
    assert sorted(p.name for p in run.iterdir()) == ["summary.json"]


def _md5(d):
    return hashlib.md5((d / "model.safetensors").read_bytes()).hexdigest()


def test_prepared_model_is_reused_only_for_the_same_recipe(tmp_path):
    cfg = load_config(None, [f"run_dir={tmp_path}", "model.warm_start_steps=0", "seed=1"])
    d = prepare_model_dir(cfg, 0, 10)
    first = _md5(d)
    assert json.loads((d / COMPLETE).read_text())["recipe"]["seed"] == 1
    assert _md5(prepare_model_dir(cfg, 0, 10)) == first  # same recipe: reused
    other = load_config(None, [f"run_dir={tmp_path}", "model.warm_start_steps=0", "seed=99"])
    with pytest.raises(TimeoutError, match="waited 0s for rank 0"):
        prepare_model_dir(other, 1, 0)  # other ranks never take the old recipe's model
    d = prepare_model_dir(other, 0, 10)
    assert _md5(d) != first and json.loads((d / COMPLETE).read_text())["recipe"]["seed"] == 99


@pytest.mark.timeout(120)
def test_unknown_reward_function_is_one_line_before_the_model_is_built(tmp_path):
    run = tmp_path / "run"
    rc, out = cli("train", "--run-dir", str(run), "reward.name=megatron_grpo.rewards:nope",
                  timeout=100)  # fmt: skip
    assert rc == 2, out[-2000:]
    assert out.strip().splitlines()[-1] == (
        "error: module 'megatron_grpo.rewards' has no attribute 'nope' (reward "
        "'megatron_grpo.rewards:nope')."
    )
    assert "Traceback" not in out and not (run / "hf_model").exists()
