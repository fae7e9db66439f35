"""Child processes never outlive the process that started them.

A rank killed with SIGKILL (OOM killer, ``kill -9``, a node agent) runs no cleanup, so every
helper process it started would stay alive with parent 1, for good. ``die_with_parent()``,
called first thing in such a child, asks Linux to SIGKILL the child when its parent dies
(``prctl(PR_SET_PDEATHSIG)``; elsewhere a watchdog thread polls the parent instead).

``start_checkpoint_manager()`` does that for the one process megatron-core starts behind our
back: ``dist_checkpointing``'s write-results queue lives in a ``multiprocessing.Manager()``
(``megatron/core/dist_checkpointing/strategies/filesystem_async.py``,
``_get_write_results_queue``), started at the first save and kept for the life of the rank.
We start that Manager ourselves, before the first save, so that it

- dies with its rank (parent-death signal), and with it the resource tracker, which exits
  when the last process holding its pipe is gone; and
- runs in its own session, so a pre-emption warning that torchrun sends to the worker's
  whole process group (``--signals-to-handle``) does not kill it: the rank handles the
  warning by saving a checkpoint, and that save needs the Manager alive; also when the
  warning comes while the Manager is starting (the first save of an attempt: a restarted
  attempt's can fall right on the warning), for SIGUSR1, SIGHUP and SIGQUIT.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None, sig: int = signal.SIGKILL) -> None:
    """Make this process get ``sig`` (default SIGKILL) when ``parent_pid`` (default: the
    current parent) dies. SIGTERM suits a process that must stop its own children (torchrun)."""
    parent_pid = os.getppid() if parent_pid is None else parent_pid
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)
    if not armed:
        threading.Thread(target=_watch_parent, args=(parent_pid, sig), daemon=True).start()


def _watch_parent(parent_pid: int, sig: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os.kill(os.getpid(), sig)


# The signals torchrun forwards to its workers' process group (slurm/common.sh
# --signals-to-handle): blocked while the Manager starts, so one that arrives before its
# os.setsid() (a spawned interpreter takes about a second to get there) does not kill it.
_GROUP_SIGNALS = (signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT, signal.SIGTERM, signal.SIGINT)


def _manager_init(parent_pid: int) -> None:
    # Ignoring drops one pending from before the setsid; the handlers are put back after.
    before = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _GROUP_SIGNALS}
    os.setsid()  # out of the rank's process group: torchrun's group-wide signals miss it
    for sig, handler in before.items():
        signal.signal(sig, handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _GROUP_SIGNALS)
    die_with_parent(parent_pid)


def start_checkpoint_manager() -> None:
    """Install a parent-bound, own-session Manager queue for dist_checkpointing's writer.

    Idempotent; a no-op when megatron-core's module (or its private queue) is not there.
    """
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    except ImportError:
        return
    if not hasattr(fa, "_results_queue") or fa._results_queue is not None:
        return
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    manager = SyncManager(ctx=mp.get_context("spawn"))
    # The spawned child starts with SIGUSR1, SIGHUP and SIGQUIT still blocked (measured; it
    # comes up with SIGTERM and SIGINT unblocked, so those can still kill a Manager that is
    # starting); this rank gets a signal that came meanwhile when it unblocks them.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _GROUP_SIGNALS)
    try:
        manager.start(initializer=_manager_init, initargs=(os.getpid(),))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    fa._results_queue = manager.Queue()
    fa._mgrpo_manager = manager  # keeps the manager (and so its process) referenced
