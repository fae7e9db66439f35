"""Every config key is read somewhere outside ``config/``: a key that nothing reads gives a
user who sets it no effect and no error (issue 12: grpo.overlong_* and sync.verify were).

A key counts as read only where the code reads that whole dotted path: ``cfg.sync.interval``
(any object's ``.sync.interval``), or ``.interval`` on a name or ``self`` attribute known to
hold the ``sync`` section: assigned from ``<...>.sync`` (``s = cfg.sync``) or annotated with
its class (``sync: SyncConfig``) in that function, its class or its module. Top-level keys
(``seed``) count on a name annotated ``Config`` or called ``cfg``/``config``. So reading
``checkpoint.interval`` no longer proves ``sync.interval`` live.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from megatron_grpo.config.schema import Config

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_grpo"


def _sections(cls: type, prefix: str = "") -> dict[str, type]:
    """``{dotted section: its class}`` of every section below ``cls``, nested ones too
    (``grpo.loss``, ``model.kernels``)."""
    out: dict[str, type] = {}
    for f in dataclasses.fields(cls):
        sub = f.default_factory
        if sub is not dataclasses.MISSING and dataclasses.is_dataclass(sub):
            out[f"{prefix}{f.name}"] = sub  # type: ignore[assignment]
            out.update(_sections(sub, f"{prefix}{f.name}."))  # type: ignore[arg-type]
    return out


SECTIONS = _sections(Config)
SECTION_OF_CLASS = {cls.__name__: name for name, cls in SECTIONS.items()}
CONFIG = "<config>"  # the alias of the whole tree


def config_keys() -> list[str]:
    """The dotted key of every leaf field of the config tree, nested sections' included."""
    keys = []
    for f in dataclasses.fields(Config):
        if f.name not in SECTIONS:
            keys.append(f.name)
    for name, cls in SECTIONS.items():
        keys += [f"{name}.{g.name}" for g in dataclasses.fields(cls)
                 if f"{name}.{g.name}" not in SECTIONS]  # fmt: skip
    return keys


def _holder(node: ast.expr) -> str | None:
    """``x`` or ``self.x`` (the names an alias can be bound to), else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return None


def _annotated_section(annotation: ast.expr | None) -> str | None:
    """The section (or CONFIG) a type annotation names: ``SyncConfig``, ``"SyncConfig"``,
    ``SyncConfig | None``."""
    if annotation is None:
        return None
    text = ast.unparse(annotation)
    for word in text.replace('"', " ").replace("|", " ").replace("'", " ").split():
        if word in SECTION_OF_CLASS:
            return SECTION_OF_CLASS[word]
        if word == "Config":
            return CONFIG
    return None


def _bindings(body: list[ast.AST], aliases: dict[str, str]) -> dict[str, str]:
    """``aliases`` plus what ``body`` (not its nested functions) binds to a section:
    ``s = cfg.sync``, ``c = s``, ``self.cfg = sync_cfg``, ``g, x = cfg.grpo, y``,
    ``sync: SyncConfig = ...``."""
    out = dict(aliases)
    assigns = []
    for node in _walk_scope(body):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
            if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                assigns += [(_holder(t), v) for t, v in zip(target.elts, value.elts)]
            else:
                assigns.append((_holder(target), value))
        elif isinstance(node, ast.AnnAssign):
            section = _annotated_section(node.annotation)
            if section and _holder(node.target):
                out[_holder(node.target)] = section
            elif node.value is not None:
                assigns.append((_holder(node.target), node.value))
    for _ in range(3):  # c = self.cfg after self.cfg = cfg: a few rounds reach every chain
        for holder, value in assigns:
            section = _section_of(value, out) if holder else None
            if section is not None and out.get(holder) != section:
                out[holder] = section
    return out


def _walk_scope(body: list[ast.AST]):
    """Every node of ``body``; nested function and class definitions are yielded, not
    entered."""
    todo = list(body)
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        todo.extend(ast.iter_child_nodes(node))


def _section_of(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """The section (or CONFIG) the expression ``node`` holds, where it is known."""
    if isinstance(node, ast.Attribute) and node.attr in SECTIONS:
        return node.attr  # cfg.sync, self.cfg.sync, args.cfg.sync
    if isinstance(node, ast.Attribute):  # a nested section: cfg.grpo.loss, g.loss
        parent = _section_of(node.value, aliases)
        if parent not in (None, CONFIG) and f"{parent}.{node.attr}" in SECTIONS:
            return f"{parent}.{node.attr}"
    holder = _holder(node)
    if holder is None:
        return None
    if holder in aliases:
        return aliases[holder]
    name = holder.rsplit(".", 1)[-1]
    if name.endswith("_cfg") and name[: -len("_cfg")] in SECTIONS and "." not in name:
        return name[: -len("_cfg")]  # the naming convention: sync_cfg, self.optim_cfg
    return CONFIG if name in ("cfg", "config") else None


class _Scan:
    """The keys one module reads. ``passed``: (function name, parameter) -> the section a
    call in the module passes it (``_surrogate_fn(c, ...)`` with ``c = grpo_cfg``): the
    section of an unannotated private helper's parameter, known from its callers."""

    def __init__(self) -> None:
        self.out: set[str] = set()
        self.passed: dict[tuple[str, str], str] = {}
        self.params: dict[str, list[str]] = {}

    def reads(self, body: list[ast.AST], aliases: dict[str, str]) -> None:
        """Add every dotted key ``body`` reads, nested scopes included."""
        aliases = _bindings(body, aliases)
        for node in _walk_scope(body):
            if isinstance(node, ast.Attribute):
                section = _section_of(node.value, aliases)
                if section is not None:
                    self.out.add(node.attr if section == CONFIG else f"{section}.{node.attr}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                self.note_call(node, aliases)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.reads(node.body, self.parameters(node, aliases))
            elif isinstance(node, ast.ClassDef):
                self.reads(node.body, self.class_aliases(node, aliases))

    def note_call(self, call: ast.Call, aliases: dict[str, str]) -> None:
        params = self.params.get(call.func.id, [])
        named = list(zip(params, call.args)) + [(k.arg, k.value) for k in call.keywords]
        for param, value in named:
            section = _section_of(value, aliases)
            if section is not None and param:
                self.passed[(call.func.id, param)] = section

    def class_aliases(self, node: ast.ClassDef, aliases: dict[str, str]) -> dict[str, str]:
        fields = _bindings(node.body, {})  # sync: SyncConfig, a dataclass-like field
        own = {**aliases, **{f"self.{k}": v for k, v in fields.items() if "." not in k}}
        for fn in node.body:  # self.x = cfg.sync (or = an annotated parameter) in a method
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                bound = _bindings(fn.body, self.parameters(fn, {}))
                own.update({k: v for k, v in bound.items() if k.startswith("self.")})
        return own

    def parameters(self, fn, aliases: dict[str, str]) -> dict[str, str]:
        """``aliases`` with ``fn``'s parameters: those annotated with a section, or passed one
        by a call in the module, bound to it; the others hide an outer name of theirs."""
        own = dict(aliases)
        for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs:
            section = _annotated_section(a.annotation) or self.passed.get((fn.name, a.arg))
            if section:
                own[a.arg] = section
            else:
                own.pop(a.arg, None)
        return own


def keys_read(sources: list[str]) -> set[str]:
    out: set[str] = set()
    for text in sources:
        tree, scan = ast.parse(text), _Scan()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                scan.params[fn.name] = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        for _ in range(3):  # a helper's callers may be helpers themselves
            scan.reads(tree.body, {})
        out |= scan.out
    return out


def _package_sources() -> list[str]:
    return [
        p.read_text(encoding="utf-8")
        for p in PACKAGE.rglob("*.py")
        if p.relative_to(PACKAGE).parts[0] != "config"
    ]


def test_every_config_key_is_read_outside_config():
    keys = config_keys()
    assert len(keys) > 60  # the walk reached every section
    read = keys_read(_package_sources())
    dead = [key for key in keys if key not in read]
    assert not dead, f"config keys read nowhere outside megatron_grpo/config/: {dead}"


def test_a_key_is_read_by_its_whole_dotted_path():
    code = """
def _helper(c, other):
    return c.clip_eps_low, other.clip_eps_high

def f(cfg, sync: SyncConfig, other):
    _helper(cfg.grpo, other)
    cfg.checkpoint.interval
    sync.min_interval
    g = cfg.grpo
    g.clip_low
    other.max_interval
    cfg.seed

class T:
    def __init__(self, cfg):
        self.s = cfg.sync
    def step(self):
        return self.s.verify

def nested(cfg, c: GRPOConfig):
    cfg.grpo.loss.entropy_coef
    k = c.kl
    k.kl_coef
    c.off_policy.tis.startswith
"""
    read = keys_read([code])
    # a nested section's key is read through it: grpo.loss.entropy_coef, not grpo.entropy_coef
    assert {"grpo.loss.entropy_coef", "grpo.kl.kl_coef", "grpo.off_policy.tis"} <= read
    assert "grpo.entropy_coef" not in read and "grpo.kl_coef" not in read
    assert "checkpoint.interval" in read and "sync.interval" not in read
    assert {"sync.min_interval", "grpo.clip_low", "seed", "sync.verify"} <= read
    assert "grpo.clip_eps_low" in read and "grpo.clip_eps_high" not in read
    assert "sync.max_interval" not in read  # `other` is not known to be the sync section
