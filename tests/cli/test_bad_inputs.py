"""Every bad input of tests/bad_inputs.py is refused in one line before any rank, model or
engine starts; docs/errors.md is the table those runs produce."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys

import pytest

from tests.bad_inputs import (
    DOC,
    RANK0_LATE,
    ROOT,
    exit_codes,
    launched_table,
    make_files,
    read_only_dir,
    run_all,
    run_all_launched,
    run_launched,
    snapshot,
    table,
)


@pytest.mark.timeout(300)
def test_bad_inputs_are_one_line_and_the_table_is_current(tmp_path):
    results = run_all(tmp_path)
    assert len(results) >= 70
    for what, argv, rc, lines in results:
        assert rc == 2 and len(lines) == 1, (what, argv, rc, lines)
        assert "error:" in lines[0] and "Traceback" not in lines[0], (what, lines)
    assert (tmp_path / "used" / "metrics.jsonl").exists()  # --overwrite refused: kept
    assert not (tmp_path / "run").exists()  # no refused case leaves a run directory behind
    assert DOC.read_text().startswith(table(results)), (
        "docs/errors.md is stale: python -m tests.bad_inputs"
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_launched_bad_inputs_are_one_line_on_every_rank_and_touch_nothing(tmp_path):
    """Under torchrun each rank is its own process: each must refuse by itself (exit 2, no
    traceback), rank 0 alone printing the line, before any rank writes the run directory."""
    make_files(tmp_path)
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(read_only_dir(tmp_path / "ro"))
        except (OSError, subprocess.CalledProcessError) as e:
            pytest.skip(f"cannot make a read-only directory here (root without mount rights): {e}")
        before = snapshot(tmp_path)
        results = run_all_launched(tmp_path)
        after = snapshot(tmp_path)
    assert after == before, "a refused launch created or changed files under $TMP"
    for what, how, argv, rc, lines, report in results:
        case = (what, how, argv, rc, lines, report[-20:])
        assert len(lines) == 1 and lines[0].startswith("error: "), case
        assert not any("megatron_grpo/cli/main.py" in x for x in lines + report), case
        if how == "one process":
            assert rc == 2 and not report, case
        else:  # torchrun exits 1 when a rank fails; each rank's own status is in its report
            assert rc == 1 and exit_codes(report) == ({0: 2, 1: 2}, 0), case
    assert DOC.read_text().endswith("\n" + launched_table(results)), (
        "docs/errors.md is stale: python -m tests.bad_inputs"
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_torchrun_refusal_prints_one_line_whichever_rank_refuses_first(tmp_path):
    """README's launch with a value every rank rejects, 20 times, each rank's checks held
    back a random 0-1 s (tests/rank_delay_site; the first launch holds rank 0 back, the
    order that lost the line in issue 34): every time the one line, printed once, and
    every rank's exit code in torchrun's report is 2, rank 0 the first failure."""
    rng = random.Random(34)
    plans = [RANK0_LATE] + [{r: round(rng.uniform(0, 1), 2) for r in (0, 1)} for _ in range(19)]
    argv = ["train", "--config", str(ROOT / "configs" / "tiny_cpu.yaml"), "grpo.group_size=-4"]
    for delays in plans:
        rc, lines, report = run_launched("torchrun", argv, tmp_path, timeout=120, delays=delays)
        case = (delays, rc, lines, report[-30:])
        assert lines == ["error: grpo.group_size=-4 must be > 0."], case
        assert rc == 1 and exit_codes(report) == ({0: 2, 1: 2}, 0), case
    assert not any(tmp_path.iterdir()), "a refused launch wrote into its working directory"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_rank_left_waiting_prints_the_line_itself(tmp_path):
    """A rank other than 0 that refuses and is never stopped (rank 0 reached another
    verdict, e.g. a file missing on its node only) prints the line itself once its wait
    (PEER_WAIT_S, 0.5 s here) is over, and exits 2: a refusal is never silent."""
    code = (
        "import sys; from megatron_grpo.cli import errors, main; errors.PEER_WAIT_S = 0.5; "
        "sys.exit(main.main(sys.argv[1:]))"
    )
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", code, "train", "grpo.group_size=-4"]
    out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=50)
    assert out.returncode == 2, out
    assert out.stdout + out.stderr == "error: grpo.group_size=-4 must be > 0.\n", out
