"""Disaggregated placement: rollout ranks serve vLLM engines, trainer ranks drive them.

One torchrun world, split by ``distributed.placement.place_ranks``: the first ``n_train`` ranks
train, the last ``num_engines * rollout.tp`` serve (engine ``e`` = consecutive ranks
``engines[e]``; its first rank, the *driver*, owns a standalone ``RolloutEngine`` whose
worker processes vLLM spawns; the other ranks of the engine idle until told to stop).

Three channels, each with one job:

- **trainer sub-world** (the trainer ranks' default process group): built from torchrun's
  rendezvous store with ``world_size = n_train`` (``distributed.init_distributed(store=...)``),
  so megatron-core, DDP and checkpoint barriers see the trainer ranks only. Megatron 0.16.1
  sizes every group from the default group (``parallel_state.initialize_model_parallel``
  asserts ``world_size == tp*pp*cp*dp``) and its optimizer/checkpoint code calls
  ``torch.distributed`` collectives on the default group, so giving the trainers their own
  default group is the one change that keeps all of that untouched.
- **control** (``rollout/control.py``): small messages over ZeroMQ, JSON and raw arrays
  checked on arrival, never pickles (``rollout/messages.py``): every process of the channel
  binds an inbox on its host and publishes its address once in torchrun's rendezvous store;
  trainer rank 0 sends commands ``cmd/<seq>`` (generate, init_transfer, update, stop) to every
  rollout rank, each driver answers ``res/<seq>/<e>``; waits block on the inbox with
  liveness checks (heartbeats both ways), so a dead peer ends in a clear error, never a hang.
  Trainer rank 0 shares results with the other trainer ranks over the sub-world.
- **weights**: the transfer group of trainer ranks + engine workers
  (``bridge.transfer_group.init_transfer_group``), running the bridge's plan and transport on
  both sides (``bridge.weight_sync``).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_grpo.config import Config
from megatron_grpo.distributed.placement import RankPlacement, place_ranks
from megatron_grpo.distributed.setup import attempt_store
from megatron_grpo.distributed.spawn import TORCHRUN_ENV
from megatron_grpo.rollout import messages
from megatron_grpo.rollout.agent import agent_loop
from megatron_grpo.rollout.colocated import engine_slice
from megatron_grpo.rollout.control import TRAINER, Channel, engine_peer, node_address, rank_peer
from megatron_grpo.rollout.engine import RolloutEngine

log = logging.getLogger(__name__)

# torchrun's environment, dropped in the driver before vLLM spawns its processes: they must
# not mistake themselves for ranks of the torchrun world.


@dataclass
class DisaggregatedWorld:
    """This process's place in a disaggregated torchrun world."""

    rank: int
    placement: RankPlacement
    store: Any
    """torchrun's rendezvous store (``torch.distributed.rendezvous("env://")``)."""
    timeout_s: float
    channel: Channel | None = None
    """This process's end of the control channel (trainer rank 0 and the rollout ranks)."""

    @property
    def is_trainer(self) -> bool:
        return self.rank in self.placement.train_ranks

    @property
    def n_train(self) -> int:
        return len(self.placement.train_ranks)

    @property
    def rollout_peers(self) -> list[str]:
        """The channel names of the rollout ranks, in rank order."""
        return [peer_name(r, self.placement) for r in self.placement.rollout_ranks]

    def abort(self, reason: str) -> None:
        """Trainer side: make every rollout rank stop waiting (start-up failed); closes this
        rank's channel."""
        if self.channel is not None and self.channel.closed:
            return  # the client said stop already (RolloutClient.shutdown)
        ch = self.channel or Channel(
            self.store, f"trainer/{self.rank}", self.timeout_s, self._host()
        )
        try:
            ch.post(self.rollout_peers, "abort", messages.abort(reason))
        finally:
            ch.close()

    def _host(self) -> str:
        return node_address(self.placement.world_size, "MEGATRON_GRPO_CONTROL_ADDR")

    def trainer_world(self) -> dict[str, Any]:
        """``init_distributed`` keywords for the trainer sub-world."""
        return {
            "store": dist.PrefixStore("megatron_grpo/train", self.store),
            "world_size": self.n_train,
        }


def join_world(cfg: Config) -> DisaggregatedWorld:
    """Connect to torchrun's rendezvous store; nothing collective happens here."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    placement = place_ranks(cfg.rollout, world)
    timeout = timedelta(seconds=cfg.parallel.timeout_s)
    store, rank, _ = next(dist.rendezvous("env://", timeout=timeout))
    store = attempt_store(store, rank, world)  # not the keys of an earlier attempt
    out = DisaggregatedWorld(rank, placement, store, cfg.parallel.timeout_s)
    if rank == 0 or not out.is_trainer:  # bound now, so an abort reaches it from the start
        out.channel = Channel(store, peer_name(rank, placement), out.timeout_s, out._host(),
                              silent_s=cfg.parallel.heartbeat_timeout_s)  # fmt: skip
    pin_role(out.is_trainer, cfg.rollout.tp)
    return out


def peer_name(rank: int, placement: RankPlacement) -> str:
    """``rank``'s name on the control channel: trainer rank 0, a driver, or a rollout rank."""
    if rank == placement.train_ranks[0]:
        return TRAINER
    drivers = {ranks[0]: e for e, ranks in enumerate(placement.engines)}
    return engine_peer(drivers[rank]) if rank in drivers else rank_peer(rank)


PIN_ENV = ("MEGATRON_GRPO_TRAINER_CPUS", "MEGATRON_GRPO_ROLLOUT_CPUS")
"""The variables naming the CPUs of the trainer ranks and of the rollout ranks."""


def pin_role(is_trainer: bool, rollout_tp: int) -> None:
    """Pin this rank to the CPUs of its role when ``MEGATRON_GRPO_TRAINER_CPUS`` /
    ``MEGATRON_GRPO_ROLLOUT_CPUS`` name them (``0``, ``0-3``, ``1,3``; ``bench throughput``
    sets them so rollout.ahead's overlap is real on a small machine). vLLM's processes
    inherit the rollout rank's affinity; with rollout.tp=1 its OpenMP threads are bound to
    the same CPUs (VLLM_CPU_OMP_THREADS_BIND, vllm/utils/ompmultiprocessing.py), with tp > 1
    ``RolloutEngine`` gives each worker one of them."""
    key = PIN_ENV[0] if is_trainer else PIN_ENV[1]
    spec = os.environ.get(key, "").strip()
    if not spec:
        return
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        os.sched_setaffinity(0, cpus)
    except (ValueError, OSError) as e:
        raise RuntimeError(
            f"{key}={spec!r}: {e}; give CPU ids this process may use "
            f"({sorted(os.sched_getaffinity(0))}), e.g. {key}=0 or 0-3."
        ) from e
    if not is_trainer and rollout_tp == 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", spec)


# ------------------------------------------------------------------------------ server
def serve(cfg: Config, world: DisaggregatedWorld) -> dict[str, Any]:
    """A rollout rank's whole life: host (driver) or idle beside an engine until ``stop``."""
    # Here, not at the top: models.prepare loads the prompt datasets and rewards, and every
    # command's error handler (cli/errors.py) imports this module through rollout.interface.
    from megatron_grpo.models.prepare import prepare_model_dir

    pl = world.placement
    e = next(i for i, ranks in enumerate(pl.engines) if world.rank in ranks)
    driver = pl.engines[e][0] == world.rank
    # Slurm's pre-emption warning reaches every rank; the trainer checkpoints and then
    # says stop, so a rollout rank only notes it.
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda s, f: log.warning("rollout rank: signal %d, serving on", s))
    ch = world.channel
    assert ch is not None  # join_world opens it on every rollout rank
    engine = agent = None
    try:
        if driver:
            hf_dir = prepare_model_dir(cfg, world.rank, cfg.parallel.timeout_s)
            engine = _start_engine(cfg, hf_dir, e, ch)
            agent = agent_loop(cfg, hf_dir)  # None without env.name
        return _serve_loop(cfg, ch, engine, e, world.rank, agent)
    finally:
        ch.close()
        if engine is not None:
            engine.shutdown()


def engine_devices(visible: str | None, local_rank: int, tp: int, device_count: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for the engine whose driver has ``local_rank``: entries
    ``[local_rank, local_rank + tp)`` of the devices this process may see.

    ``visible`` is the inherited ``CUDA_VISIBLE_DEVICES`` (Slurm sets it to the job's GPUs
    on the node, e.g. ``"4,5,6,7"`` or GPU UUIDs), or None, when the node's
    ``device_count`` GPUs are all visible. The driver's rollout ranks are consecutive local
    ranks (``distributed.placement.place_ranks``), so engine ``e`` gets the GPUs of its own ranks;
    taking ``0..tp-1`` instead would stack every engine of a node on the same GPUs.
    """
    if visible is None:
        entries = [str(i) for i in range(device_count)]
    else:
        entries = [v.strip() for v in visible.split(",") if v.strip()]
    if local_rank < 0 or tp < 1 or local_rank + tp > len(entries):
        seen = "no CUDA_VISIBLE_DEVICES" if visible is None else f"CUDA_VISIBLE_DEVICES={visible!r}"
        raise RuntimeError(
            f"rollout engine on LOCAL_RANK={local_rank} needs GPUs [{local_rank}, "
            f"{local_rank + tp}) (rollout.tp={tp}) but this process sees {len(entries)} "
            f"({seen}): launch one process per visible GPU (torchrun --nproc-per-node) and "
            "give the job as many GPUs per node."
        )
    return ",".join(entries[local_rank : local_rank + tp])


def _start_engine(cfg: Config, hf_dir: Any, e: int, ch: Channel) -> Any:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    for k in TORCHRUN_ENV:
        os.environ.pop(k, None)
    # vLLM's engine core runs in-process when this is 0, and its worker would then build
    # its torch.distributed world in this process (vllm/v1/engine/llm_engine.py).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    if torch.cuda.is_available():
        os.environ["CUDA_VISIBLE_DEVICES"] = engine_devices(
            os.environ.get("CUDA_VISIBLE_DEVICES"),
            local_rank,
            cfg.rollout.tp,
            torch.cuda.device_count(),
        )
    ch.beat_forever([TRAINER])
    t0 = time.perf_counter()
    try:
        engine = RolloutEngine.from_config(hf_dir, cfg.rollout)
    except Exception as exc:
        ch.post(TRAINER, f"ready/{e}", messages.error(f"{type(exc).__name__}: {exc}"))
        raise
    engine.replica_index = e  # per-replica sampling seeds, as colocated engines have
    ch.post(TRAINER, f"ready/{e}", messages.ready(time.perf_counter() - t0))
    return engine


def _serve_loop(
    cfg: Config, ch: Channel, engine: Any, e: int, rank: int, agent: Any = None
) -> dict[str, Any]:
    seq = 0
    while True:
        key = f"cmd/{seq}"
        try:
            cmd = ch.wait(key, [TRAINER], f"command {seq} from trainer rank 0", ("command",)).body
        except messages.BadMessage as exc:  # the trainer hears why, then this rank stops
            if engine is not None:
                ch.post(TRAINER, f"res/{seq}/{e}", messages.error(f"BadMessage: {exc}"))
            raise
        op = cmd["op"]
        if op == "stop":
            return {"preempted": False, "step": None, "role": "rollout", "rank": rank}
        if engine is not None:
            try:
                ch.post(TRAINER, f"res/{seq}/{e}", _run(engine, cmd, e, agent))
            except Exception as exc:  # reported to the trainer, which decides
                log.exception("rollout engine %d: %s failed", e, op)
                ch.post(TRAINER, f"res/{seq}/{e}", messages.error(f"{type(exc).__name__}: {exc}"))
        seq += 1


def _run(engine: Any, cmd: dict[str, Any], e: int, agent: Any = None) -> bytes:
    """Run one command (checked against ``messages.COMMANDS``); its encoded answer."""
    op = cmd["op"]
    if op == "generate":  # this engine's share, split as the colocated engines split
        prompts, sampling = cmd["prompts"], cmd["sampling"]
        share = engine_slice(len(prompts), cmd["engines"], e)
        if agent is None or cmd.get("rows") is None:
            return messages.samples(engine.generate(prompts[share], **sampling))
        return messages.samples(
            agent.generate(engine, prompts[share], cmd["rows"][share], **sampling)
        )
    if op == "init_transfer":
        info = dict(cmd["info"], rank_offset=cmd["rank_offsets"][e])
        engine.init_transfer(info)
        return messages.reply(ok=True)
    if op == "update":
        # Each worker runs the receiving half of the plan's transport (update_info by
        # worker rank, vllm/v1/worker/gpu_worker.py: update_weights).
        engine.update_weights_remote([{"plan": True}] * engine.tp)
        return messages.reply(version=engine.weight_version)
    raise ValueError(f"unknown rollout command {op!r}")
