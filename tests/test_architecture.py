"""The layers of docs/architecture.md hold: no module imports a layer above its own, and no
files import each other in a loop (the table in the doc is what this test reads)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
SOURCES = ("megatron_grpo", "checkpoints_tools")


def layers() -> dict[str, int]:
    """``{package: layer}`` from the doc's table rows ``| N | `pkg`, `pkg` | ... |``."""
    out = {}
    for m in re.finditer(r"^\| (\d+) \| ((?:`\w+`(?:, )?)+) \|", DOC.read_text(), re.M):
        for name in re.findall(r"`(\w+)`", m.group(2)):
            out[name] = int(m.group(1))
    return out


def modules() -> dict[str, Path]:
    out = {}
    for top in SOURCES:
        for f in (ROOT / top).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = f
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports, anywhere in the file (functions included);
    ``from pkg import sub`` counts as importing ``pkg.sub`` when that is a module."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            out.update([s for s in subs if s in known] or [node.module])
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in known}


def package(module: str) -> str:
    parts = module.split(".")
    return parts[0] if parts[0] == "checkpoints_tools" else parts[1] if len(parts) > 1 else ""


def test_every_package_has_a_layer_in_the_doc():
    table = layers()
    packages = {package(m) for m in modules()} - {""}
    assert packages <= set(table), f"add to docs/architecture.md's table: {packages - set(table)}"
    assert set(table) <= packages, f"the doc names packages that are gone: {set(table) - packages}"


def test_no_import_runs_up_a_layer():
    table, known = layers(), modules()
    upward = []
    for name, path in known.items():
        src = table.get(package(name))
        for dst in imports(path, known):
            if src is not None and table.get(package(dst), 0) > src:
                upward.append(f"{name} (layer {src}) imports {dst} (layer {table[package(dst)]})")
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    known = modules()
    graph = {name: imports(path, known) - {name} for name, path in known.items()}
    cycles, index, low, stack, on = [], {}, {}, [], set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                on.discard(w)
                comp.append(w)
            on.discard(v)
            if comp:
                cycles.append(sorted([v, *comp]))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"modules that import each other in a loop: {cycles}"


def test_the_checks_see_an_upward_import_and_a_cycle(tmp_path, monkeypatch):
    """The checks can fail: a fake tree with rollout -> trainer and a two-file loop."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "architecture.md").write_text(
        "| 1 | `rollout` | x |\n| 2 | `trainer` | y |\n"
    )
    pkg = tmp_path / "megatron_grpo"
    for sub in ("rollout", "trainer"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "rollout" / "a.py").write_text("from megatron_grpo.trainer import b\n")
    (pkg / "trainer" / "b.py").write_text("import megatron_grpo.rollout.a\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "DOC", tmp_path / "docs" / "architecture.md")
    try:
        test_no_import_runs_up_a_layer()
    except AssertionError as e:
        assert "megatron_grpo.rollout.a (layer 1) imports megatron_grpo.trainer.b" in str(e)
    else:
        raise AssertionError("the upward import was not seen")
    try:
        test_no_import_cycle()
    except AssertionError as e:
        assert "megatron_grpo.rollout.a" in str(e) and "megatron_grpo.trainer.b" in str(e)
    else:
        raise AssertionError("the cycle was not seen")
