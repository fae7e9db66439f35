"""Prove that the GPU install resolves: a pip resolver dry run of ``setup.py``'s ``gpu``
extra plus the base requirements, for linux x86_64 and a given Python, from any machine.

    python -m megatron_grpo.platform.gpu_install [--python-version 3.12] [--json OUT]

What it runs (no install, nothing written to the environment)::

    pip install --isolated --dry-run --ignore-installed --report - --no-cache-dir
        --use-feature=fast-deps --python-version 3.12 --only-binary=:all:
        --platform manylinux_2_17_x86_64 ... --platform manylinux_2_35_x86_64
        <base requirements and gpu extra, one requirement per project>

- ``--isolated`` and ``PIP_CONFIG_FILE=/dev/null``: none of this machine's pip config
  (local wheel folders, CPU torch constraints) applies; the registry is PyPI.
- ``--platform`` is exact in pip (``manylinux_2_28`` does not admit ``manylinux_2_17``
  wheels), so every glibc tag from 2.17 to 2.35 (Ubuntu 22.04; NGC containers have newer)
  is listed: vLLM's dependencies ship wheels tagged anywhere in that range.
- ``--use-feature=fast-deps``: the metadata of wheels without PEP 658 metadata (torch,
  the CUDA libraries) is read with HTTP range requests instead of downloading the wheel:
  about 80 MB in 60-110 s where a plain dry run downloads those wheels whole (torch alone: 527 MB, measured).
- One requirement per project (``merge_same_name``): setup.py names torch twice (``>=2.6``
  in the base, ``==2.13.0`` in the extra), and pip would read torch 2.15.0's metadata (~20 s
  of range requests) for the first before the pin rules it out.
- ``--only-binary=:all:``: nothing is built. Transformer-Engine's PyTorch extension is an
  sdist and therefore not in the extra (docs/install.md builds it, or uses the NGC image).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

SETUP_PY = Path(__file__).resolve().parents[2] / "setup.py"
PLATFORMS = ["manylinux2014_x86_64"] + [f"manylinux_2_{v}_x86_64" for v in range(17, 36)]
EXPECTED = {
    "vllm": "0.32.0",
    "torch": "2.13.0",
    # setup.py: 0.16.1 below Python 3.12, 0.19.2 from 3.12 on (the dry run is for 3.12)
    "megatron-core": "0.19.2",
    "transformer-engine": "2.11.0",
    "transformer-engine-cu13": "2.11.0",
    "liger-kernel": "0.8.5",
}
"""Versions the resolution must contain (what the code is verified against)."""


INDEX_PROBE = "https://pypi.org/simple/vllm/"


class RegistryUnreachable(RuntimeError):
    """pip could not reach the package index (offline machine)."""


def requirements(setup_py: Path = SETUP_PY) -> tuple[list[str], list[str]]:
    """(install_requires, extras_require["gpu"]) read from setup.py without running it:
    string constants and module-level string/list assignments are resolved by name."""
    tree = ast.parse(setup_py.read_text())
    names: dict[str, object] = {}

    def value(node):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return names[node.id]
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.JoinedStr):  # f"vllm=={VLLM_VERSION}"
            return "".join(
                str(value(v.value)) if isinstance(v, ast.FormattedValue) else v.value
                for v in node.values
            )
        if isinstance(node, ast.Dict):
            return {value(k): value(v) for k, v in zip(node.keys, node.values)}
        raise ValueError(f"setup.py: cannot read {ast.dump(node)[:80]} without running it")

    setup_kwargs = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                names[target.id] = value(node.value)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            setup_kwargs = {k.arg: k.value for k in node.value.keywords}
    base = value(setup_kwargs["install_requires"])
    gpu = value(setup_kwargs["extras_require"])["gpu"]
    return base, gpu


def for_python(reqs: list[str], python_version: str) -> list[str]:
    """``reqs`` with their environment markers decided for ``python_version`` (pip decides
    markers for the interpreter that runs it, not for ``--python-version``): a requirement
    whose marker is false there is dropped, the others lose their marker."""
    from packaging.requirements import Requirement

    env = {"python_version": python_version, "python_full_version": f"{python_version}.0"}
    out = []
    for text in reqs:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        req.marker = None
        out.append(str(req))
    return out


def merge_same_name(reqs: list[str]) -> list[str]:
    """``reqs`` with the requirements of one project joined into one (specifiers and extras
    together, at the first one's place): ``torch>=2.6`` and ``torch==2.13.0`` become
    ``torch==2.13.0,>=2.6``. The same resolution, without pip's metadata read for the best
    candidate of each root requirement alone (the module's docstring). Markers must already
    be decided (``for_python``)."""
    from packaging.requirements import Requirement

    merged: dict[str, Requirement] = {}
    for text in reqs:
        req = Requirement(text)
        if req.marker is not None or req.url:
            raise ValueError(f"merge_same_name: {text!r} has a marker or URL: decide it first")
        name = canonical(req.name)
        if name not in merged:
            merged[name] = req
            continue
        first = merged[name]
        first.specifier &= req.specifier
        first.extras |= req.extras
    return [str(r) for r in merged.values()]


def canonical(name: str) -> str:
    """PEP 503 name: ``transformer_engine_cu13`` -> ``transformer-engine-cu13``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pip_command(reqs: list[str], python_version: str) -> list[str]:
    cmd = [
        sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed",
        "--report", "-", "--quiet", "--no-cache-dir", "--use-feature=fast-deps",
        "--python-version", python_version, "--only-binary=:all:",
    ]  # fmt: skip
    for p in PLATFORMS:
        cmd += ["--platform", p]
    return cmd + reqs


def check_index(url: str = INDEX_PROBE, timeout_s: float = 15.0) -> None:
    """Raise RegistryUnreachable unless the index answers: pip itself, offline, ends in "no
    matching distribution", which cannot be told apart from pins that do not resolve."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            r.read(1)
    except (urllib.error.URLError, OSError) as e:
        raise RegistryUnreachable(f"{url} did not answer ({e})") from None


def resolve(python_version: str = "3.12", timeout_s: float = 600.0) -> dict:
    """Run the dry run; return ``{"seconds", "requirements", "packages": {name: version}}``.
    Raises RegistryUnreachable when the index cannot be reached, RuntimeError (naming pip's
    last error line) when the pins do not resolve together."""
    base, gpu = requirements()
    reqs = merge_same_name(for_python(base + gpu, python_version))
    check_index()
    t0 = time.perf_counter()
    try:
        # PIP_CONFIG_FILE=devnull: even with --isolated, pip reads the site-wide config
        # (seen here: /etc/xdg/pip's constraints file capping torch); the answer must not
        # depend on the machine that asks.
        env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
        out = subprocess.run(
            pip_command(reqs, python_version),
            capture_output=True, text=True, timeout=timeout_s, env=env,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"pip's resolver dry run ran past {timeout_s:.0f}s") from None
    seconds = time.perf_counter() - t0
    if out.returncode != 0:
        err = [ln for ln in out.stderr.splitlines() if ln.strip()]
        text = " ".join(err[-3:])
        if any(
            s in out.stderr
            for s in ("NewConnectionError", "Temporary failure in name resolution",
                      "Max retries exceeded", "Network is unreachable", "ProxyError")
        ):  # fmt: skip
            raise RegistryUnreachable(f"package index unreachable: {text[-300:]}")
        raise RuntimeError(
            f"the gpu extra does not resolve for Python {python_version} on linux x86_64: "
            f"{text[-500:]}"
        )
    report = json.loads(out.stdout)
    packages = {
        canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]
    }
    return {"seconds": seconds, "requirements": reqs, "packages": packages}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python-version", default="3.12")
    ap.add_argument(
        "--json",
        help="write the resolution (name -> version) here; on failure "
        '{"error": message, "unreachable": whether PyPI could not be reached}',
    )
    args = ap.parse_args(argv)
    try:
        res = resolve(args.python_version)
    except (RegistryUnreachable, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        if args.json:
            failed = {"error": str(e), "unreachable": isinstance(e, RegistryUnreachable)}
            Path(args.json).write_text(json.dumps(failed) + "\n")
        return 2
    pk = res["packages"]
    wrong = {k: (pk.get(k), v) for k, v in EXPECTED.items() if pk.get(k) != v}
    print(
        f"resolved {len(pk)} packages in {res['seconds']:.0f}s for Python "
        f"{args.python_version} / linux x86_64: "
        + ", ".join(f"{k} {pk.get(k)}" for k in (*EXPECTED, "flashinfer-python", "transformers"))
    )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    if wrong:
        print(f"error: resolved versions differ from the verified ones: {wrong}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
