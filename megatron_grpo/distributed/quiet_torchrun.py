"""torchrun for the launches the project starts itself, without torchrun's report of a refusal.

``python -m megatron_grpo.distributed.quiet_torchrun ARGS`` is ``torchrun ARGS``
(torch/distributed/run.py ``main``), except when every failed rank exited 2, the code of a
refusal (cli/errors.py), or was one torchrun stopped itself once another had (a rank still
importing when rank 0 refused ends by torchrun's SIGTERM, exit -15): rank 0 has printed the
one ``error:`` line, and torchrun's
``failed (exitcode: 2)`` log line and its ``ChildFailedError`` traceback (~35 lines) would
only bury it. Then it exits 2 with nothing more. Any other failure (a crash, a rank killed,
exit 1 or 3) prints torchrun's report as torchrun does. A signal that stops torchrun itself
(srun's TERM to the other nodes once one node's torchrun exited, a ``scancel``, a
pre-emption warning it forwarded to its ranks) is one line, not the ~30-line traceback of
its ``SignalException``, and exit 1 as torchrun's (the Slurm templates read no more into it),
unless torchrun had already seen each of its failed ranks exit 2: then the stop came while a
refusal was ending (srun's TERM, once another node's torchrun exited first) and the exit is
the refusal's 2, quietly;
so is a lost rendezvous (``RendezvousError``: the node that held the store has stopped, or
its address is wrong), which is how another node's torchrun often learns of the stop.

Used by ``train`` run as one process (``spawn.run_under_torchrun``), by
launchers/cpu_demo.sh and launchers/torchrun.sh, and by the slurm/ templates; a torchrun a
user types prints its report (docs/launch.md).
"""

from __future__ import annotations

import logging
import signal
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

    def _first_args(self, msg: str) -> set[str]:
        """The first argument (a pid, an exit code) of each held line of format ``msg``."""
        return {
            str(r.args[0])
            for r in self.held
            if r.msg.startswith(msg) and isinstance(r.args, tuple) and r.args
        }

    def closed_pids(self) -> set[str]:
        """The ranks torchrun stopped itself, after another rank had failed."""
        return self._first_args(self.HELD[0])

    def refused(self) -> bool:
        """Whether torchrun has said its ranks failed, each with the refusal's code."""
        return self._first_args(self.HELD[1]) == {str(REFUSED)}


class _DropTracesOf(logging.Filter):
    """Drops a record that carries the traceback of an exception of ``kinds``: torchrun's log
    tailer (``--tee``) logs the ``SignalException`` that stops it once per rank as a
    traceback (elastic/multiprocessing/tail_log.py), beside the one line said for it."""

    def __init__(self, *kinds: type[BaseException]) -> None:
        super().__init__()
        self.kinds = kinds

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], self.kinds))


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import main as torchrun

    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    hold = _HoldStopLines()
    logger.addFilter(hold)
    tailer = logging.getLogger("torch.distributed.elastic.multiprocessing.tail_log")
    drop = _DropTracesOf(SignalException)
    tailer.addFilter(drop)
    refused = False
    try:
        torchrun(argv)
    except ChildFailedError as e:
        closed = hold.closed_pids()
        causes = {f.exitcode for f in e.failures.values() if str(f.pid) not in closed}
        refused = causes == {REFUSED}
        if refused:
            return REFUSED
        raise
    except SignalException as e:
        if hold.refused():
            # Its ranks had refused and torchrun was ending when the stop came (srun's TERM
            # once another node's torchrun exited first): the refusal's exit, quietly.
            refused = True
            return REFUSED
        name = signal.Signals(e.sigval).name
        print(f"torchrun: stopped by {name}; its ranks were sent {name} too", file=sys.stderr)
        return 1
    except RendezvousError as e:
        print(f"torchrun: lost the rendezvous ({type(e).__name__}: {e}): the node holding its "
              "store stopped (see the other nodes' lines) or --rdzv-endpoint is wrong",
              file=sys.stderr)  # fmt: skip
        return 1
    finally:  # anything but a refusal (a crash, a signal): torchrun's lines, then its report
        logger.removeFilter(hold)
        tailer.removeFilter(drop)
        for record in [] if refused else hold.held:
            logger.handle(record)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
