"""Every bad input of tests/bad_inputs.py is refused in one line, exit 2, before any rank,
model or engine starts; docs/errors.md is the table those runs produce."""

from __future__ import annotations

import pytest

from tests.bad_inputs import DOC, run_all, table


@pytest.mark.timeout(300)
def test_bad_inputs_are_one_line_and_the_table_is_current(tmp_path):
    results = run_all(tmp_path)
    assert len(results) >= 70
    for what, argv, rc, lines in results:
        assert rc == 2 and len(lines) == 1, (what, argv, rc, lines)
        assert "error:" in lines[0] and "Traceback" not in lines[0], (what, lines)
    assert DOC.read_text() == table(results), "docs/errors.md is stale: python -m tests.bad_inputs"
