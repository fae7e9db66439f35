"""Installs the NCCL-rules emulation (``tests/nccl_rules.py``) at interpreter start-up in
every Python process that has this directory on ``PYTHONPATH`` and
``MEGATRON_GRPO_NCCL_RULES`` set: for code that spawns its own ranks (``bench sync``),
where no test helper runs first."""

import os
import sys

if os.environ.get("MEGATRON_GRPO_NCCL_RULES", "0") not in ("", "0"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.nccl_rules import maybe_install

    maybe_install()
