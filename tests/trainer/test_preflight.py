"""``megatron-grpo train``'s refusals before anything is built (trainer/preflight.py,
trainer/run_dir.py) and the ranks it would start, run in the test process: the command line's ``main`` with every rank
spawner and ``build.train`` replaced by a stub that raises (tests/bad_inputs.py
``run_case``), so a case that got past its check fails with exit code 99 instead of
training. That the same checks refuse in real processes, one and under torchrun, is
tests/cli/test_bad_inputs.py's launched cases."""

from __future__ import annotations

from megatron_grpo.checkpoint import LoopState, save_checkpoint
from megatron_grpo.config import load_config
from megatron_grpo.config.loader import save_config
from megatron_grpo.trainer.run_dir import run_config
from tests.bad_inputs import ROOT, run_case

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


def test_a_preset_whose_heads_tp_cannot_split_is_refused_first_and_leaves_no_run_dir(tmp_path):
    """tiny (a preset: no config.json to read) has 4 heads: parallel.tp=3 gets the head-count
    line, not first the world's prompt split (3 ranks) and then, after the ranks started,
    the heads; nothing is written."""
    rc, lines = run_case(["train", "--verbose", "--run-dir", "$TMP/r", "parallel.tp=3"], tmp_path)
    assert (rc, lines) == (2, [
        "error: num_heads(4) is not divisible by parallel.tp(3): every TP rank holds "
        "num_heads/tp attention heads; choose parallel.tp from [1, 2, 4]."
    ])  # fmt: skip
    assert not (tmp_path / "r").exists()


def test_wandb_project_without_wandb_is_refused_before_the_model(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))  # fmt: skip
    argv = ["train", "--verbose", "--run-dir", "$TMP/r", "logging.wandb_project=demo"]
    rc, lines = run_case(argv, tmp_path)
    assert rc == 2 and len(lines) == 1, lines
    assert "logging.wandb_project='demo' but the wandb package is not installed" in lines[0]
    assert not (tmp_path / "r").exists()


def _launch(argv: list[str], cwd, monkeypatch) -> list[tuple[list[str], int]]:
    """``megatron-grpo *argv`` as one process, in ``cwd``, with torchrun replaced by a
    recorder: the (rank argv, number of ranks) it would have started."""
    from megatron_grpo.cli import main as cli_main
    from megatron_grpo.distributed import spawn

    started: list[tuple[list[str], int]] = []
    monkeypatch.setattr(spawn, "run_under_torchrun", lambda a, n: started.append((a, n)) or 0)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(cwd)
    assert cli_main.main(argv) == 0
    return started


def test_one_process_train_of_the_moe_config_starts_the_ranks_expert_parallelism_needs(
    tmp_path, monkeypatch
):
    """configs/tiny_moe_cpu.yaml (parallel.ep=2, dp left to the world) as one process: 2
    ranks, not 1 and a refusal that ep=2 does not divide dp=1."""
    config = str(ROOT / "configs" / "tiny_moe_cpu.yaml")
    started = _launch(["train", "--config", config, "--steps", "6", "--run-dir", "r"],
                      tmp_path, monkeypatch)  # fmt: skip
    assert started == [(["train", "--config", config, "run_dir=r", "steps=6"], 2)]


def test_resume_without_config_reads_the_run_dirs_config_and_its_ranks_get_it_too(
    tmp_path, monkeypatch
):
    """A run of the MoE config, stopped at step 2: `train --run-dir R --resume --steps 8`
    resumes it with its own config.yaml (overrides on top), not the built-in dense default;
    the ranks it starts get that file. A --config of another model is refused in one line."""
    run = tmp_path / "r"
    cfg = load_config(ROOT / "configs" / "tiny_moe_cpu.yaml", ["run_dir=r", "steps=4"])
    save_config(cfg, run)
    (run / "metrics.jsonl").write_text('{"step": 2}\n')
    save_checkpoint(run, LoopState(step=2), save_rng=False)
    argv = ["train", "--run-dir", "r", "--resume", "--steps", "8", "grpo.group_size=4"]
    started = _launch(argv, tmp_path, monkeypatch)
    rank_argv = ["train", "--config", "r/config.yaml", "--resume", "grpo.group_size=4", "run_dir=r",
                 "steps=8"]  # fmt: skip
    assert started == [(rank_argv, 2)]  # ep=2 from the run's config: 2 ranks
    resumed, _ = run_config(None, argv[-1:] + ["run_dir=r", "steps=8"], True)
    assert (resumed.model.hf_path, resumed.parallel.ep) == ("tiny-moe", 2)
    assert (resumed.steps, resumed.grpo.group_size) == (8, 4)

    rc, lines = run_case(["train", "--resume", "--run-dir", "$TMP/r", "--config",
                          str(ROOT / "configs" / "tiny_cpu.yaml")], tmp_path)  # fmt: skip
    assert rc == 2 and len(lines) == 1, lines
    assert "trains model.hf_path=tiny (num_experts=0), but the checkpoint in $TMP/r holds " \
           "model.hf_path=tiny-moe (num_experts=4)" in lines[0]  # fmt: skip


def test_resume_of_a_finished_run_says_so_and_starts_nothing(tmp_path):
    run = tmp_path / "r"
    save_config(load_config(None, ["run_dir=r", "steps=4"]), run)
    (run / "metrics.jsonl").write_text('{"step": 4}\n')
    save_checkpoint(run, LoopState(step=4), save_rng=False)
    rc, lines = run_case(["train", "--resume", "--run-dir", "$TMP/r"], tmp_path)
    assert (rc, lines) == (2, [
        "error: run_dir='$TMP/r' holds a finished run (trained to step 4, steps=4): nothing "
        "to resume; to train it further pass --resume --steps N with N > 4, or start afresh "
        "with --overwrite."
    ])  # fmt: skip
    # further steps are a resume: past the checks (run_case's stub stands in for training)
    argv = ["train", "--verbose", "--resume", "--run-dir", "$TMP/r", "--steps", "6"]
    assert run_case(argv, tmp_path)[0] == 99
