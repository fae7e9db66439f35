"""torchrun for the launches the project starts itself, without torchrun's report of a refusal.

``python -m megatron_grpo.distributed.quiet_torchrun ARGS`` is ``torchrun ARGS``
(torch/distributed/run.py ``main``), except when every failed rank exited 2, the code of a
refusal (cli/errors.py): rank 0 has printed the one ``error:`` line, and torchrun's
``failed (exitcode: 2)`` log line and its ``ChildFailedError`` traceback (~35 lines) would
only bury it. Then it exits 2 with nothing more. Any other failure (a crash, a rank killed,
exit 1 or 3) prints torchrun's report as torchrun does.

Used by ``train`` run as one process (``spawn.run_under_torchrun``) and by
launchers/cpu_demo.sh and launchers/torchrun.sh; a torchrun a user types prints its report
(docs/launch.md).
"""

from __future__ import annotations

import logging
import sys

REFUSED = 2


class _HoldStopLines(logging.Filter):
    """Holds torchrun's lines about stopping its ranks (elastic/multiprocessing/api.py:
    ``Sending process N closing signal SIGTERM``, ``failed (exitcode: 2) ...``) until the
    outcome is known: dropped after a refusal, shown after any other failure."""

    HELD = ("Sending process %s closing signal", "failed (exitcode: %s)")

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(self.HELD):
            self.held.append(record)
            return False
        return True


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    hold = _HoldStopLines()
    logger.addFilter(hold)
    refused = False
    try:
        torchrun(argv)
    except ChildFailedError as e:
        refused = {f.exitcode for f in e.failures.values()} == {REFUSED}
        if refused:
            return REFUSED
        raise
    finally:  # anything but a refusal (a crash, a signal): torchrun's lines, then its report
        logger.removeFilter(hold)
        for record in [] if refused else hold.held:
            logger.handle(record)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
