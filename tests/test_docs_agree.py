"""Issue 47 item 11: README, Makefile and docs give one time for each make command, and the
install extras the docs name exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMANDS = ("make demo", "make test", "make test-fast")
TIME = re.compile(r"~\s*(\d+)\s*(min|s)\b")


def _claims() -> dict[str, set[str]]:
    files = [REPO / "README.md", REPO / "Makefile", *sorted((REPO / "docs").glob("*.md"))]
    out: dict[str, set[str]] = {c: set() for c in COMMANDS}
    for f in files:
        for line in f.read_text().splitlines():
            for cmd in COMMANDS:
                if re.search(re.escape(cmd) + r"(?![-\w])", line):
                    out[cmd] |= {f"{n} {u}" for n, u in TIME.findall(line)}
    return out


def test_one_time_per_command():
    claims = _claims()
    assert all(claims.values()), claims  # each command's time is given somewhere
    assert {c: v for c, v in claims.items() if len(v) > 1} == {}


def test_wandb_extra_exists():
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(
        n for n in ast.walk(tree) if isinstance(n, ast.keyword) and n.arg == "extras_require"
    )
    assert "wandb" in [k.value for k in call.value.keys]  # type: ignore[attr-defined]


def test_eval_doc_evaluates_the_demo_on_its_training_task():
    """Issue 47 item 5: docs/eval.md's demo evaluation uses the task `make demo` trains on
    (launchers/cpu_demo.sh's config), not another one."""
    from megatron_grpo.config import load_config

    demo = re.search(r"CONFIG=\$\{CONFIG:-(\S+)\}", (REPO / "launchers/cpu_demo.sh").read_text())
    assert demo is not None
    trained_on = load_config(str(REPO / demo.group(1)), []).data.source
    evals = re.findall(
        r"eval --model runs/demo\S* --data (\S+)", (REPO / "docs/eval.md").read_text()
    )
    assert evals and set(evals) == {trained_on}, (evals, trained_on)
