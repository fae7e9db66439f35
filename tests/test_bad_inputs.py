"""Every bad input of tests/bad_inputs.py is refused in one line before any rank, model or
engine starts; docs/errors.md is the table those runs produce."""

from __future__ import annotations

import contextlib
import re
import subprocess

import pytest

from tests.bad_inputs import (
    DOC,
    launched_table,
    make_files,
    read_only_dir,
    run_all,
    run_all_launched,
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
    assert DOC.read_text().startswith(table(results)), (
        "docs/errors.md is stale: python -m tests.bad_inputs"
    )


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
            codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", "\n".join(report))]
            assert rc == 1 and codes, case
            assert all(c == 2 or c < 0 for c in codes), case  # < 0: stopped by torchrun
    assert DOC.read_text().endswith("\n" + launched_table(results)), (
        "docs/errors.md is stale: python -m tests.bad_inputs"
    )
