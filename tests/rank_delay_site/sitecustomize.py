"""Test-only hook (tests/cli/test_bad_inputs.py, tests/cli/test_launch.py): in a torchrun worker
(RANK set) of a process that has this directory on ``PYTHONPATH`` and
``MEGATRON_GRPO_TEST_RANK_DELAY`` set ("0:0.8,1:0.1": seconds per global rank), delays that
rank's ``megatron_grpo.config.load_config``, the first step of ``train``'s checks, so a test
chooses which rank refuses first. The package never reads the variable; nothing else changes.
"""

import os
import time

_delays = os.environ.get("MEGATRON_GRPO_TEST_RANK_DELAY", "")
if _delays and "RANK" in os.environ:
    import megatron_grpo.config as _config

    _delay = float(dict(x.split(":") for x in _delays.split(",")).get(os.environ["RANK"], 0))
    _load_config = _config.load_config

    def _delayed_load_config(*args, **kwargs):
        time.sleep(_delay)
        return _load_config(*args, **kwargs)

    _config.load_config = _delayed_load_config
