"""Test-only hook (tests/cli/test_launch.py): in a torchrun worker (RANK set) of a process that
has this directory on ``PYTHONPATH`` and ``MEGATRON_GRPO_TEST_KILL`` set ("RANK:STEP"), kills
that global rank (SIGKILL, no cleanup) right after step STEP, on its torchrun agent's first
attempt only (``TORCHELASTIC_RESTART_COUNT`` 0): a rank lost mid-run, for the in-job restart
through the Slurm templates, which start ``-m megatron_grpo.cli.main`` themselves
(tests/e2e/test_faults.py wraps the CLI in a script instead). The package never reads the
variable.
"""

import os

_kill = os.environ.get("MEGATRON_GRPO_TEST_KILL", "")
if _kill and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    _rank, _step = (int(x) for x in _kill.split(":"))
    if os.environ.get("RANK") == str(_rank):
        import signal

        from megatron_grpo.trainer.checkpointer import Checkpointer

        _after_step = Checkpointer.after_step

        def _killing_after_step(self, step, state):
            out = _after_step(self, step, state)
            if step == _step and self.ctx.rank == _rank:
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        Checkpointer.after_step = _killing_after_step
