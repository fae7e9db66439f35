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
- **control** (``rollout/control.py``): small messages in torchrun's rendezvous store
  (``TCPStore``), JSON and raw arrays checked on arrival, never pickles
  (``rollout/messages.py``): trainer rank 0 posts commands ``cmd/<seq>`` (generate,
  init_transfer, update, stop), each driver answers ``res/<seq>/<e>``; waits poll with
  liveness checks (heartbeat counters both ways), so a dead peer ends in a clear error, never
  a hang.
  Trainer rank 0 shares results with the other trainer ranks over the sub-world.
- **weights**: the transfer group of trainer ranks + engine workers
  (``bridge.transfer_group.init_transfer_group``), running the bridge's plan and transport on
  both sides (``bridge.weight_sync``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_grpo.bridge.transfer_group import PlanInputs, init_transfer_group
from megatron_grpo.bridge.weight_sync import remote_sender
from megatron_grpo.config import Config
from megatron_grpo.distributed.placement import RankPlacement, place_ranks
from megatron_grpo.rollout import messages
from megatron_grpo.rollout.colocated import engine_slice
from megatron_grpo.rollout.control import Channel, engine_beat, trainer_beat
from megatron_grpo.rollout.engine import RolloutEngine

log = logging.getLogger(__name__)

# torchrun's environment, dropped in the driver before vLLM spawns its processes: they must
# not mistake themselves for ranks of the torchrun world.
_TORCHRUN_ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip


@dataclass
class DisaggregatedWorld:
    """This process's place in a disaggregated torchrun world."""

    rank: int
    placement: RankPlacement
    store: Any
    """torchrun's rendezvous store (``torch.distributed.rendezvous("env://")``)."""
    timeout_s: float

    @property
    def is_trainer(self) -> bool:
        return self.rank in self.placement.train_ranks

    @property
    def n_train(self) -> int:
        return len(self.placement.train_ranks)

    def abort(self, reason: str) -> None:
        """Trainer side: make every rollout rank stop waiting (start-up failed)."""
        Channel(self.store, self.timeout_s).post("abort", messages.abort(reason))

    def trainer_world(self) -> dict[str, Any]:
        """``init_distributed`` keywords for the trainer sub-world."""
        return {"store": dist.PrefixStore("megatron_grpo/train", self.store),
                "world_size": self.n_train}  # fmt: skip


def join_world(cfg: Config) -> DisaggregatedWorld:
    """Connect to torchrun's rendezvous store; nothing collective happens here."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    placement = place_ranks(cfg.rollout, world)
    timeout = timedelta(seconds=cfg.parallel.timeout_s)
    store, rank, _ = next(dist.rendezvous("env://", timeout=timeout))
    out = DisaggregatedWorld(rank, placement, store, cfg.parallel.timeout_s)
    pin_role(out.is_trainer, cfg.rollout.tp)
    return out


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
    ch = Channel(world.store, world.timeout_s)
    engine = None
    try:
        if driver:
            hf_dir = prepare_model_dir(cfg, world.rank, cfg.parallel.timeout_s)
            engine = _start_engine(cfg, hf_dir, e, ch)
        return _serve_loop(cfg, ch, engine, e, world.rank)
    finally:
        ch.stop_beating()
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
    for k in _TORCHRUN_ENV:
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
    ch.beat_forever(engine_beat(e))
    t0 = time.perf_counter()
    try:
        engine = RolloutEngine.from_config(hf_dir, cfg.rollout)
    except Exception as exc:
        ch.post(f"ready/{e}", messages.error(f"{type(exc).__name__}: {exc}"))
        raise
    engine.replica_index = e  # per-replica sampling seeds, as colocated engines have
    ch.post(f"ready/{e}", messages.ready(time.perf_counter() - t0))
    return engine


def _serve_loop(cfg: Config, ch: Channel, engine: Any, e: int, rank: int) -> dict[str, Any]:
    seq = 0
    while True:
        key = f"cmd/{seq}"
        try:
            cmd = ch.wait(key, [trainer_beat()], f"command {seq} from trainer rank 0",
                          ("command",), take=False).body  # fmt: skip
        except messages.BadMessage as exc:  # the trainer hears why, then this rank stops
            if engine is not None:
                ch.post(f"res/{seq}/{e}", messages.error(f"BadMessage: {exc}"))
            raise
        op = cmd["op"]
        if op == "stop":
            return {"preempted": False, "step": None, "role": "rollout", "rank": rank}
        if engine is not None:
            try:
                ch.post(f"res/{seq}/{e}", _run(engine, cmd, e))
            except Exception as exc:  # reported to the trainer, which decides
                log.exception("rollout engine %d: %s failed", e, op)
                ch.post(f"res/{seq}/{e}", messages.error(f"{type(exc).__name__}: {exc}"))
        seq += 1


def _run(engine: Any, cmd: dict[str, Any], e: int) -> bytes:
    """Run one command (checked against ``messages.COMMANDS``); its encoded answer."""
    op = cmd["op"]
    if op == "generate":  # this engine's share, split as the colocated engines split
        prompts = cmd["prompts"]
        return messages.samples(engine.generate(
            prompts[engine_slice(len(prompts), cmd["engines"], e)], **cmd["sampling"]
        ))  # fmt: skip
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


# ------------------------------------------------------------------------------ client
class RolloutClient:
    """The trainer ranks' handle on the disaggregated engines, behind the rollout interface
    (``rollout.interface.Rollout``: ``launch``, ``generate``, ``shutdown``).

    Trainer rank 0 talks to the drivers; every trainer rank gets the same results.
    """

    def __init__(self, world: DisaggregatedWorld, ctx: Any) -> None:
        self.world, self.ctx = world, ctx
        self.engines = len(world.placement.engines)
        self.ch = Channel(world.store, world.timeout_s) if ctx.rank == 0 else None
        self._seq = 0
        self._stopped = False
        if self.ch is not None:
            self.ch.beat_forever(trainer_beat())

    # -- rank 0's side of the protocol
    def _post(self, op: str, **payload: Any) -> int:
        assert self.ch is not None
        seq, self._seq = self._seq, self._seq + 1
        self.ch.post(f"cmd/{seq}", messages.command(op, **payload))
        return seq

    def _collect(self, seq: int, what: str, expect: tuple[str, ...] = ("reply",)) -> list[Any]:
        """Every engine's answer to command ``seq`` (``expect``: its kinds besides error)."""
        expect = (*expect, "error")
        assert self.ch is not None
        out = []
        for e in range(self.engines):
            driver = self.world.placement.engines[e][0]
            r = self.ch.wait(f"res/{seq}/{e}", [engine_beat(e)],
                             f"engine {e}'s {what}, from rank {driver}", expect)  # fmt: skip
            if r.kind == "error":
                raise RuntimeError(
                    f"rollout engine {e} (rank {driver}) failed its {what}: {r.body['error']}"
                )
            out.append(r.body)
        return out

    def share(self, fn: Any) -> Any:
        """``fn()`` on trainer rank 0, its result (or its error) on every trainer rank
        (``Rollout.share``)."""
        box: list[Any] = [None]
        if self.ctx.rank == 0:
            try:
                box[0] = ("ok", fn())
            except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
                box[0] = ("error", f"{type(exc).__name__}: {exc}")
                if self.ctx.world_size == 1:
                    raise
        if self.ctx.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        status, value = box[0]
        if status == "error":
            raise RuntimeError(value)
        return value

    # -- what the trainer calls
    def wait_ready(self) -> float:
        """Seconds the slowest engine took to start."""

        def ready() -> float:
            assert self.ch is not None
            secs = []
            for e in range(self.engines):
                r = self.ch.wait(f"ready/{e}", [engine_beat(e)], f"engine {e} to start",
                                 ("ready", "error"))  # fmt: skip
                if r.kind == "error":
                    raise RuntimeError(f"rollout engine {e} failed to start: {r.body['error']}")
                secs.append(r.body["seconds"])
            return max(secs)

        return self.share(ready)

    def generate(self, prompt_ids: list, seed: int, **sampling: Any) -> list:
        """All prompts' samples, prompt-major, on every trainer rank: engine e samples
        prompts ``[e*P//E, (e+1)*P//E)``, as colocated engines do (``rollout.colocated``).
        One step's ``launch``, posted and received on rank 0 inside ``share`` (an error
        there reaches every trainer rank)."""
        return self.share(lambda: self.launch([(prompt_ids, seed)], **sampling)[0]())

    def _submit(self, prompt_ids: list, **sampling: Any) -> int | None:
        """Queue a ``generate`` without waiting (rollout.ahead): the engines run queued
        commands back to back, in order; ``_receive(ticket)`` waits for the samples. The
        ticket is meaningful on trainer rank 0 only (other ranks get theirs from rank 0)."""
        if self.ctx.rank != 0:
            return None
        return self._post("generate", prompts=[list(p) for p in prompt_ids],
                          engines=self.engines, sampling=sampling)  # fmt: skip

    def launch(self, steps: list[tuple[list, int]], **sampling: Any) -> list:
        """Queue one generate per step (``[(prompt_ids, seed)]``) on the engines, which run
        them back to back while the trainer trains; returns one thunk per step that collects
        its samples (rollout.ahead). Each step is its own vLLM call with its own seed, so
        the samples are the serial schedule's, bit for bit."""
        tickets = [self._submit(ids, seed=seed, **sampling) for ids, seed in steps]
        return [(lambda t=t: self._receive(t)) for t in tickets]

    def _receive(self, ticket: int | None) -> list | None:
        """A launched step's samples on trainer rank 0 (None elsewhere): the control channel
        only, no collective, so the arrivals thread may wait here (rollout/ahead.py)."""
        if self.ch is None:
            return None
        return [s for part in self._collect(ticket, "generate", ("samples",)) for s in part]

    def init_transfer(self, inputs: Any, backend: str, timeout_s: float) -> Any:
        """Build the transfer group (trainer ranks + every engine worker); returns it."""

        def address() -> tuple[str, int]:
            addr = _my_address(self.world.placement.world_size)
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            return addr, port

        addr, port = self.share(address)
        world = self.world.placement.world_size
        seq = None
        if self.ctx.rank == 0:
            info = dict(master_address=addr, master_port=port, world_size=world,
                        backend=backend, timeout_s=timeout_s, plan=inputs.to_dict())  # fmt: skip
            offsets = [ranks[0] for ranks in self.world.placement.engines]
            seq = self._post("init_transfer", info=info, rank_offsets=offsets)
        # Gloo/NCCL group construction blocks until all WORLD ranks joined (drivers' workers
        # join inside the init_weight_transfer_engine RPC).
        group = init_transfer_group(addr, port, self.ctx.rank, world, backend, timeout_s)
        self.share(lambda: self._collect(seq, "init_transfer"))
        return group

    def begin_update(self) -> None:
        self._update_seq = self._post("update")

    def end_update(self) -> None:
        self._collect(self._update_seq, "weight update")

    def shutdown(self) -> None:
        """Tell every rollout rank to stop (idempotent; trainer rank 0 only)."""
        if self._stopped:
            return
        self._stopped = True
        if self.ch is not None:
            try:
                self._post("stop")
            finally:
                self.ch.stop_beating()


def _my_address(world_size: int) -> str:
    """Trainer rank 0's address for the transfer group's store."""
    explicit = os.environ.get("MEGATRON_GRPO_TRANSFER_ADDR")
    if explicit:
        return explicit
    if int(os.environ.get("LOCAL_WORLD_SIZE", "0")) == world_size:
        return "127.0.0.1"  # one node
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.getfqdn()


def connect_rollout(cfg: Config, world: DisaggregatedWorld, ctx: Any, hf_dir: Any, policy: Any):
    """Trainer ranks: wait for the engines, build the transfer group and the bridge.
    Returns ``(RolloutClient, WeightSender)``: the colocated ``(engine, WeightSender)``'s
    faces."""
    client = RolloutClient(world, ctx)
    client.wait_ready()
    engines = world.placement.engines
    inputs = PlanInputs.of(hf_dir, ctx, policy, cfg.sync, cfg.rollout.tp, engines)
    group = client.init_transfer(inputs, ctx.backend, cfg.sync.timeout_s)
    rank0 = ctx.rank == 0
    sync = remote_sender(
        inputs, ctx, group,
        begin=client.begin_update if rank0 else None, end=client.end_update if rank0 else None,
    )  # fmt: skip
    return client, sync
