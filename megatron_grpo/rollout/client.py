"""The trainer ranks' side of the disaggregated placement: ``RolloutClient`` drives the
engines that ``rollout.server`` serves (over the control channel, ``rollout/control.py``),
behind the rollout interface; ``connect_rollout`` builds it and the bridge's sender.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import torch.distributed as dist

from megatron_grpo.bridge.transfer_group import PlanInputs, init_transfer_group
from megatron_grpo.bridge.weight_sync import remote_sender
from megatron_grpo.config import Config
from megatron_grpo.rollout import messages
from megatron_grpo.rollout.agent import StepPrompts
from megatron_grpo.rollout.control import engine_peer, node_address
from megatron_grpo.rollout.server import DisaggregatedWorld

log = logging.getLogger(__name__)


class RolloutClient:
    """The trainer ranks' handle on the disaggregated engines, behind the rollout interface
    (``rollout.interface.Rollout``: ``launch``, ``generate``, ``shutdown``).

    Trainer rank 0 talks to the drivers; every trainer rank gets the same results.
    """

    def __init__(self, world: DisaggregatedWorld, ctx: Any) -> None:
        self.world, self.ctx = world, ctx
        self.engines = len(world.placement.engines)
        self.ch = world.channel if ctx.rank == 0 else None
        self.peers = world.rollout_peers
        self._seq = 0
        self._stopped = False
        if self.ch is not None:
            self.ch.beat_forever(self.peers)

    # -- rank 0's side of the protocol
    def _post(self, op: str, **payload: Any) -> int:
        assert self.ch is not None
        seq, self._seq = self._seq, self._seq + 1
        self.ch.post(self.peers, f"cmd/{seq}", messages.command(op, **payload))
        return seq

    def _collect(self, seq: int, what: str, expect: tuple[str, ...] = ("reply",)) -> list[Any]:
        """Every engine's answer to command ``seq`` (``expect``: its kinds besides error)."""
        expect = (*expect, "error")
        assert self.ch is not None
        out = []
        for e in range(self.engines):
            driver = self.world.placement.engines[e][0]
            r = self.ch.wait(f"res/{seq}/{e}", [engine_peer(e)],
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
                r = self.ch.wait(
                    f"ready/{e}", [engine_peer(e)], f"engine {e} to start", ("ready", "error")
                )
                if r.kind == "error":
                    raise RuntimeError(f"rollout engine {e} failed to start: {r.body['error']}")
                secs.append(r.body["seconds"])
            return max(secs)

        return self.share(ready)

    def generate(self, prompt_ids: list, seed: int, rows: list | None = None,
                 **sampling: Any) -> list:  # fmt: skip
        """All prompts' samples, prompt-major, on every trainer rank: engine e samples
        prompts ``[e*P//E, (e+1)*P//E)``, as colocated engines do (``rollout.colocated``).
        One step's ``launch``, posted and received on rank 0 inside ``share`` (an error
        there reaches every trainer rank)."""
        step: StepPrompts = (prompt_ids, seed) if rows is None else (prompt_ids, seed, rows)
        return self.share(lambda: self.launch([step], **sampling)[0]())

    def _submit(self, prompt_ids: list, rows: list | None, **sampling: Any) -> int | None:
        """Queue a ``generate`` without waiting (rollout.ahead): the engines run queued
        commands back to back, in order; ``_receive(ticket)`` waits for the samples. The
        ticket is meaningful on trainer rank 0 only (other ranks get theirs from rank 0)."""
        if self.ctx.rank != 0:
            return None
        extra = {} if rows is None else {"rows": list(rows)}
        return self._post("generate", prompts=[list(p) for p in prompt_ids],
                          engines=self.engines, sampling=sampling, **extra)  # fmt: skip

    def launch(self, steps: list[StepPrompts], **sampling: Any) -> list:
        """Queue one generate per step (``[(prompt_ids, seed[, rows])]``) on the engines, which run
        them back to back while the trainer trains; returns one thunk per step that collects
        its samples (rollout.ahead). Each step is its own vLLM call with its own seed, so
        the samples are the serial schedule's, bit for bit."""
        tickets = [
            self._submit(ids, rows[0] if rows else None, seed=seed, **sampling)
            for ids, seed, *rows in steps
        ]
        return [(lambda t=t: self._receive(t)) for t in tickets]

    def _receive(self, ticket: int | None) -> list | None:
        """A launched step's samples on trainer rank 0 (None elsewhere): the control channel
        only, no collective, so the arrivals thread may wait here (rollout/ahead.py)."""
        if self.ch is None:
            return None
        assert ticket is not None  # rank 0 (it has the channel) posted it: _submit's int
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

        def collect() -> list[Any]:
            assert seq is not None  # share runs this on rank 0 only, which posted seq above
            return self._collect(seq, "init_transfer")

        self.share(collect)
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
                self.ch.close()  # delivers the stop first (control._LINGER_MS)


def _my_address(world_size: int) -> str:
    """Trainer rank 0's address for the transfer group's store."""
    return node_address(world_size, "MEGATRON_GRPO_TRANSFER_ADDR")


def connect_rollout(cfg: Config, world: DisaggregatedWorld, ctx: Any, hf_dir: Any, policy: Any):
    """Trainer ranks: wait for the engines, build the transfer group and the bridge.
    Returns ``(RolloutClient, WeightSender)``: the colocated ``(engine, WeightSender)``'s
    faces."""
    client = RolloutClient(world, ctx)
    client.wait_ready()
    engines = world.placement.engines
    inputs = PlanInputs.of(
        hf_dir, ctx, policy, cfg.sync, cfg.rollout.tp, engines, cfg.rollout.expert_parallel
    )
    group = client.init_transfer(inputs, ctx.backend, cfg.sync.timeout_s)
    rank0 = ctx.rank == 0
    sync = remote_sender(
        inputs, ctx, group,
        begin=client.begin_update if rank0 else None, end=client.end_update if rank0 else None,
    )  # fmt: skip
    return client, sync
