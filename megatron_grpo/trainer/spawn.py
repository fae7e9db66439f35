"""``megatron-grpo train`` as one process: start the ranks the layout needs under torchrun.

``eval`` and ``bench`` spawn their own ranks; ``train`` does the same when it is not under
torchrun (no ``WORLD_SIZE``) and the layout needs more than one rank: it re-runs the same
command as ``torchrun --standalone --nproc-per-node N`` on this machine, after every check
that can fail has passed in this process. The torchrun process gets SIGTERM when this one
dies (parent-death signal), and SIGTERM / SIGUSR1 sent here are passed on to it.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys

from megatron_grpo.config.schema import Config


def ranks_needed(cfg: Config) -> int:
    """The smallest local world the layout fits: tp*pp*cp*dp trainer ranks (dp 0: 1), made
    a multiple of rollout.tp for colocated engines; disaggregated layouts need torchrun."""
    p = cfg.parallel
    world = p.tp * p.pp * p.cp * max(p.dp, 1)
    if cfg.rollout.placement == "colocated" and not p.dp:
        world = math.lcm(world, cfg.rollout.tp)
    return world


def run_under_torchrun(argv: list[str], nproc: int) -> int:
    """``torchrun --standalone --nproc-per-node nproc -m megatron_grpo.cli.main *argv``;
    returns its exit status."""
    from megatron_grpo.platform.lifetime import die_with_parent

    parent = os.getpid()
    env = {**os.environ}
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "megatron_grpo.cli.main", *argv]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env,
                            preexec_fn=lambda: die_with_parent(parent, signal.SIGTERM))  # fmt: skip

    def forward(signum, frame):
        proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, forward)
    return proc.wait()
