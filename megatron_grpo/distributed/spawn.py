"""Start the local ranks of a job: a function on N spawned processes, or a command under torchrun.

``spawn_ranks(fn, world, *args)`` runs ``fn(rank, world, *args)`` in ``world`` fresh
``spawn`` processes with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR=127.0.0.1 and a free MASTER_PORT) and returns what each rank returned, in rank
order, through ``torch.save`` files in a temporary directory, read back with
``torch.load(weights_only=True)``: plain data (tensors, numbers, strings, bytes, None, lists,
tuples, sets, dicts) and the classes the caller names in ``result_types``, never arbitrary
pickled objects. ``eval``, ``bench sync`` and the distributed tests start their ranks this
way, so that they need no launcher.

``run_under_torchrun(argv, nproc)`` is how ``megatron-grpo train`` run as one process starts
the ranks its layout needs (:func:`ranks_needed`): it re-runs the same command as
``torchrun --standalone --nproc-per-node N`` on this machine. The torchrun process gets
SIGTERM when this one dies (parent-death signal), and SIGTERM / SIGUSR1 / SIGINT sent here
are passed on to it.

Lifetime: every spawned rank gets SIGKILL when the process that started it dies
(``platform.lifetime.die_with_parent``), so a killed ``eval`` / ``bench`` / test leaves no
rank behind; and every process started here is joined, or killed by its own handle, before
``spawn_ranks`` returns, whatever happens (never by name).
"""

from __future__ import annotations

import math
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from megatron_grpo.config.deprecated import SHOWN_VAR as DEPRECATIONS_SHOWN
from megatron_grpo.config.schema import Config
from megatron_grpo.platform.lifetime import die_with_parent


class RankFailed(RuntimeError):
    """A spawned rank raised, died, or the ranks ran past their time limit."""


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
TORCHRUN_ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip
"""torchrun's variables: a process that is not a rank of the job (a standalone vLLM engine,
the judge) must not see them."""
"""Linux's ephemeral ports: what the kernel hands to every bind to port 0 and every connect."""


def free_port() -> int:
    """A TCP port free a moment ago on 127.0.0.1, for a rendezvous that rank 0 binds seconds
    later. Drawn at random below the kernel's ephemeral range (``EPHEMERAL_RANGE``): a port
    of that range, once released, can go to any process's bind(0) before rank 0 listens,
    and another job's gloo ranks listen on such ports, so this job's ranks would knock on
    that job's mesh and break it. Below the range only a caller naming the port can take
    it; ``spawn_ranks`` retries the rare draw that collides. Port 0's pick where the range
    is unknown."""
    for port in _draws_below_ephemeral():
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _draws_below_ephemeral(tries: int = 64) -> list[int]:
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return []
    first = max(10000, low - 16384)
    if low - first < 1024:
        return []
    draw = random.SystemRandom()  # not the seeded global stream: two spawns draw apart
    return [draw.randrange(first, low) for _ in range(tries)]


def _rank_main(
    fn: Callable, rank: int, world: int, port: int, out_dir: str, env: dict[str, str],
    threads: int | None, setup: Callable[[], object] | None, args: tuple,
    result_types: tuple[type, ...] = (),
) -> None:  # fmt: skip
    die_with_parent()  # a killed parent must not leave its ranks behind
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env,
    )  # fmt: skip
    out = Path(out_dir)
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        if setup is not None:
            setup()
        _save_result(fn(rank, world, *args), out / f"{rank}.pt", result_types)
    except BaseException:  # noqa: BLE001 - reported to the parent through the file
        (out / f"{rank}.err").write_text(traceback.format_exc())
        code = 1
    else:
        code = 0
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip teardown: vLLM and gloo threads (a failed collective's pending operations) may
    # hold the interpreter at exit.
    os._exit(code)


def _save_result(result: Any, path: Path, result_types: tuple[type, ...]) -> None:
    """``result`` at ``path``, once the parent's ``torch.load(weights_only=True)`` can read it."""
    tmp = path.with_suffix(".pt.tmp")
    torch.save(result, tmp)
    named = {f"{t.__module__}.{t.__qualname__}" for t in result_types}
    other = sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(tmp)) - named)
    if other:
        raise TypeError(
            f"the rank's result holds {', '.join(other)}, which spawn_ranks does not unpickle: "
            "return plain data (tensors, numbers, strings, lists, tuples, dicts) or name the "
            "class in spawn_ranks(..., result_types=(...))."
        )
    tmp.rename(path)


def _load_result(path: Path, rank: int, result_types: tuple[type, ...]) -> Any:
    """Rank ``rank``'s result: plain data and ``result_types`` only, nothing else unpickled."""
    try:
        with torch.serialization.safe_globals(list(result_types)):
            return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:  # torch's text: the line that names the global
        why = next((ln.split("error: ", 1)[1].split(". Please")[0]
                    for ln in str(e).splitlines() if "WeightsUnpickler error: " in ln), str(e))  # fmt: skip
        raise RankFailed(
            f"rank {rank}'s result is refused by torch.load(weights_only=True): {why}; return "
            "plain data or name the class in spawn_ranks(..., result_types=(...))."
        ) from None


def spawn_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout_s: float = 1800.0,
    env: dict[str, str] | None = None,
    threads: int | None = None,
    setup: Callable[[], object] | None = None,
    result_types: tuple[type, ...] = (),
) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned ranks; their results in rank order.

    ``fn`` (and ``setup``) must be module-level functions (pickled by name); ``env`` is
    added to each rank's environment; ``threads`` sets OMP_NUM_THREADS and torch's thread
    count in each rank; ``setup()`` runs in each rank before ``fn``. A rank's result holds
    plain data and instances of ``result_types`` (e.g. ``rollout.samples.Sample``), which the
    parent reads with ``torch.load(weights_only=True)``; a rank returning anything else fails,
    naming the type. If a rank raises,
    the other ranks are killed and :class:`RankFailed` carries its traceback; past
    ``timeout_s`` every rank is killed and the error names those still running.
    """
    env = dict(env or {})
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    for attempt in range(PORT_ATTEMPTS):
        try:
            return _spawn_once(fn, world, args, timeout_s, env, threads, setup, result_types)
        except RankFailed as e:
            # free_port's port was taken between its check and rank 0's TCPStore bind (by
            # another caller that drew the same port): the ranks failed at their
            # rendezvous, before fn's work, so a fresh port is a clean retry.
            if "EADDRINUSE" not in str(e) or attempt == PORT_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


PORT_ATTEMPTS = 3
"""Spawns tried when rank 0's rendezvous port was taken before it could listen."""


def _spawn_once(fn, world, args, timeout_s, env, threads, setup, result_types) -> list[Any]:
    name = getattr(fn, "__name__", repr(fn))
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = []
    with tempfile.TemporaryDirectory(prefix="mgrpo_ranks_") as out_dir:
        out = Path(out_dir)
        try:
            for r in range(world):
                a = (fn, r, world, port, out_dir, env, threads, setup, args, result_types)
                procs.append(ctx.Process(target=_rank_main, args=a))
                procs[-1].start()
            deadline = time.monotonic() + timeout_s
            while any(p.is_alive() for p in procs):
                if any(p.exitcode not in (None, 0) for p in procs):
                    break  # one rank failed: the others are killed below
                if time.monotonic() > deadline:
                    alive = [r for r, p in enumerate(procs) if p.is_alive()]
                    raise RankFailed(
                        f"{name} on {world} ranks ran past {timeout_s:.0f}s; ranks {alive} "
                        "were still running and were killed."
                    )
                time.sleep(0.05)
            errors = sorted(out.glob("*.err"))
            if errors:
                raise RankFailed(
                    f"rank {errors[0].stem} of {world} failed in {name}:\n{errors[0].read_text()}"
                )
            bad = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
            if bad:
                raise RankFailed(f"ranks died in {name} (rank: exit code) {bad}")
            missing = [r for r in range(world) if not (out / f"{r}.pt").exists()]
            if missing:
                codes = {r: procs[r].exitcode for r in missing}
                raise RankFailed(f"ranks {missing} returned no result (exit codes {codes})")
            return [_load_result(out / f"{r}.pt", r, result_types) for r in range(world)]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)


# ------------------------------------------------------------------------------ torchrun


def ranks_needed(cfg: Config) -> int:
    """The smallest local world the layout fits: tp*pp*cp*dp trainer ranks, where dp 0 (the
    world decides) is the least data parallelism that expert parallelism is carved from
    (``parallel.ep`` divides dp*cp: ``distributed/validate.py``), made a multiple of
    rollout.tp for colocated engines; disaggregated layouts need torchrun."""
    p = cfg.parallel
    dp = p.dp or p.ep // math.gcd(p.ep, p.cp)
    world = p.tp * p.pp * p.cp * dp
    if cfg.rollout.placement == "colocated" and not p.dp:
        world = math.lcm(world, cfg.rollout.tp)
    return world


def torchrun_argv(nproc: int, *argv: str, quiet: bool = False) -> list[str]:
    """``torchrun --standalone --nproc-per-node nproc -m megatron_grpo.cli.main *argv``; with
    ``quiet``, through ``quiet_torchrun``: a refusal on every rank ends it with the ranks' one
    line, without torchrun's report."""
    launcher = "megatron_grpo.distributed.quiet_torchrun" if quiet else "torch.distributed.run"
    return [sys.executable, "-m", launcher, "--standalone",
            f"--nproc-per-node={nproc}", "-m", "megatron_grpo.cli.main", *argv]  # fmt: skip


def run_under_torchrun(argv: list[str], nproc: int) -> int:
    """:func:`torchrun_argv` as a child bound to this process; returns its exit status."""
    parent = os.getpid()
    env = {**os.environ, DEPRECATIONS_SHOWN: "1"}  # this process printed the config's notices
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(torchrun_argv(nproc, *argv, quiet=True), env=env,
                            preexec_fn=lambda: die_with_parent(parent, signal.SIGTERM))  # fmt: skip

    def forward(signum, frame):
        proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, forward)
    return proc.wait()
