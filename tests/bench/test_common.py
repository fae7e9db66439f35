"""``bench/common.py``: the one console-table formatter every bench command prints with."""

from __future__ import annotations

from megatron_grpo.bench.common import format_table


def test_one_formatter_aligns_cells_and_keeps_spanning_lines_whole():
    text = format_table(
        ("name", "n"), [("a", 1), "a line as it is", ("longer-name", 12345)], (-6, 4), " ",
        head=["what ran"], foot=["what it means"],
    )  # fmt: skip
    assert text.splitlines() == [
        "what ran",
        "name      n",  # a negative width left-aligns, a positive one right-aligns
        "a         1",
        "a line as it is",
        "longer-name 12345",  # a cell wider than its column is printed whole
        "what it means",
    ]
