"""``megatron-grpo train``'s refusals before anything is built (trainer/preflight.py,
trainer/run_dir.py), run in the test process: the command line's ``main`` with every rank
spawner and ``build.train`` replaced by a stub that raises (tests/bad_inputs.py
``run_case``), so a case that got past its check fails with exit code 99 instead of
training. That the same checks refuse in real processes, one and under torchrun, is
tests/cli/test_bad_inputs.py's launched cases."""

from __future__ import annotations

from tests.bad_inputs import run_case

FAST = ["grpo.group_size=4", "grpo.batch.prompts_per_step=4", "grpo.batch.micro_batch_size=16"]


def test_world_that_does_not_fit_is_one_clear_line_before_the_warm_start(tmp_path):
    # One process spawns the ranks a layout needs (tp*pp*dp = 2 here), but rollout.tp=4
    # cannot be placed on them: refused before any rank starts or any model is built.
    argv = ["train", "--run-dir", "$TMP/r", "parallel.tp=2", "parallel.dp=1", "rollout.tp=4"]
    rc, lines = run_case([*argv, *FAST], tmp_path)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: rollout.tp(4) does not divide the world size 2"), lines
    assert not (tmp_path / "r" / "hf_model").exists()


def test_missing_data_file_is_one_clear_line(tmp_path):
    argv = ["train", "--run-dir", "$TMP/r", "data.source=/nonexistent/train.jsonl"]
    rc, lines = run_case([*argv, "reward.name=gsm8k", *FAST], tmp_path)
    assert rc == 2 and len(lines) == 1, lines
    assert "/nonexistent/train.jsonl" in lines[0]


def test_resume_without_checkpoint_says_so(tmp_path):
    rc, lines = run_case(["train", "--run-dir", "$TMP/r", "--resume", "--steps", "2"], tmp_path)
    assert rc == 2 and len(lines) == 1, lines
    assert "no complete checkpoint" in lines[0]


def test_train_refuses_a_used_run_dir_before_building_anything(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text("{}")
    rc, lines = run_case(["train", "--run-dir", "$TMP/run", "--steps", "1"], tmp_path)
    assert rc == 2, lines
    assert lines == [
        "error: run_dir='$TMP/run' already holds a run (summary.json): continue it with "
        "--resume, replace it with --overwrite, or pass another --run-dir."
    ]
    assert sorted(p.name for p in run.iterdir()) == ["summary.json"]


def test_unknown_reward_function_is_one_line_before_the_model_is_built(tmp_path):
    argv = ["train", "--run-dir", "$TMP/run", "reward.name=megatron_grpo.rewards:nope"]
    rc, lines = run_case(argv, tmp_path)
    assert rc == 2, lines
    assert lines == [
        "error: module 'megatron_grpo.rewards' has no attribute 'nope' (reward "
        "'megatron_grpo.rewards:nope')."
    ]
    assert not (tmp_path / "run" / "hf_model").exists()
