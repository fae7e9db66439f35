"""``bench control``: trainer rank 0 and one engine driver, two spawned processes on this
machine, exchange commands over a control channel as a disaggregated run does (heartbeats
both ways, every message encoded and checked); the round trip of each command, from encoding
it to holding the decoded answer, per channel (``zmq``: rollout/control.py; ``store``: the
store-polling channel it replaced, ``store_channel.py``)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from megatron_grpo.bench.common import columns, machine_info, package_versions
from megatron_grpo.bench.control.store_channel import Channel as StoreChannel
from megatron_grpo.distributed.spawn import spawn_ranks
from megatron_grpo.rollout import control, messages
from megatron_grpo.rollout.samples import Sample

CHANNELS = ("store", "zmq")
WARMUP = 5
"""Round trips of each command left out of the figures (connections, first allocations)."""


@dataclass(frozen=True)
class BenchControlArgs:
    channels: list[str] = dataclasses.field(default_factory=lambda: list(CHANNELS))
    """Which channels to measure, in this order."""
    repeats: int = 100
    """Timed round trips per command and channel (after the warm-up)."""
    samples: int = 64
    """Samples in each ``generate``'s answer (the engine's share of a step)."""
    tokens: int = 256
    """Response tokens per sample (prompts: 64 tokens)."""
    timeout_s: float = 300.0
    """Time limit of one channel's two processes."""

    def __post_init__(self) -> None:
        if unknown := [c for c in self.channels if c not in CHANNELS]:
            raise ValueError(f"--channels {unknown[0]!r}: expected some of {','.join(CHANNELS)}")
        if self.repeats < 1 or self.samples < 1 or self.tokens < 1:
            raise ValueError(
                f"--repeats {self.repeats}, --samples {self.samples}, --tokens {self.tokens}: "
                "each must be at least 1."
            )


class _StoreEnd:
    """One side of the store-polling channel, driven as rollout/server.py and client.py drove it."""

    def __init__(self, store: Any, rank: int, timeout_s: float) -> None:
        self.ch = StoreChannel(store, timeout_s)
        self.ch.beat_forever("hb/trainer" if rank == 0 else "hb/engine/0")
        self.peer_beat = "hb/engine/0" if rank == 0 else "hb/trainer"

    def send(self, key: str, data: bytes) -> None:
        self.ch.post(key, data)

    def receive(self, key: str, expect: tuple[str, ...]) -> messages.Message:
        # The rollout ranks read commands without taking them (every rank reads each one).
        return self.ch.wait(key, [self.peer_beat], key, expect, take=not key.startswith("cmd/"))

    def close(self) -> None:
        self.ch.stop_beating()


class _ZmqEnd:
    """One side of rollout/control.py's channel."""

    def __init__(self, store: Any, rank: int, timeout_s: float) -> None:
        me, self.peer = (
            (control.TRAINER, control.engine_peer(0))
            if rank == 0
            else (control.engine_peer(0), control.TRAINER)
        )
        self.ch = control.Channel(store, me, timeout_s)
        self.ch.beat_forever([self.peer])

    def send(self, key: str, data: bytes) -> None:
        self.ch.post(self.peer, key, data)

    def receive(self, key: str, expect: tuple[str, ...]) -> messages.Message:
        return self.ch.wait(key, [self.peer], key, expect)

    def close(self) -> None:
        self.ch.close()


_ENDS: dict[str, type[_StoreEnd] | type[_ZmqEnd]] = {"store": _StoreEnd, "zmq": _ZmqEnd}


def _commands(a: BenchControlArgs) -> dict[str, dict[str, Any]]:
    """The timed commands, by row label: an ``update`` (a tiny reply) and a ``generate``
    whose answer is ``samples`` x ``tokens`` sampled tokens."""
    sampling = dict(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=a.tokens, seed=1)
    prompts = [[7] * 64 for _ in range(a.samples)]
    return {
        "update -> reply": {"op": "update"},
        "generate -> samples": {
            "op": "generate",
            "prompts": prompts,
            "engines": 1,
            "sampling": sampling,
        },  # fmt: skip
    }


def _rank(rank: int, world: int, channel: str, a: dict) -> dict[str, list[float]] | None:
    """Rank 0 drives (returns each command's round trips, seconds); rank 1 answers."""
    args = BenchControlArgs(**a)
    store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=args.timeout_s)))
    end = _ENDS[channel](store, rank, args.timeout_s)
    out: dict[str, list[float]] | None = None
    try:
        if rank == 0:
            out = _drive(end, args)
        else:
            _answer(end, args)
    finally:
        end.close()
    # Rank 0 hosts the store (torchrun's agent does in a run): it leaves after rank 1.
    if rank == 1:
        store.set("bench/done", "1")
    else:
        store.wait(["bench/done"])
    return out


def _drive(end: Any, a: BenchControlArgs) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    seq = 0
    for label, cmd in _commands(a).items():
        out[label] = []
        for i in range(WARMUP + a.repeats):
            t0 = time.perf_counter()
            end.send(f"cmd/{seq}", messages.command(**cmd))
            end.receive(f"res/{seq}/0", ("reply", "samples"))
            if i >= WARMUP:
                out[label].append(time.perf_counter() - t0)
            seq += 1
    end.send(f"cmd/{seq}", messages.command("stop"))
    return out


def _answer(end: Any, a: BenchControlArgs) -> None:
    """The driver's loop (rollout/server.py ``_serve_loop``), with a fixed batch of samples
    standing in for vLLM's."""
    batch = [
        Sample([7] * 64, list(range(a.tokens)), [-0.5] * a.tokens, "length", "0")
        for _ in range(a.samples)
    ]
    seq = 0
    while True:
        cmd = end.receive(f"cmd/{seq}", ("command",)).body
        if cmd["op"] == "stop":
            return None
        answer = messages.samples(batch) if cmd["op"] == "generate" else messages.reply(version=seq)
        end.send(f"res/{seq}/0", answer)
        seq += 1


def run_bench_control(a: BenchControlArgs) -> dict[str, Any]:
    """Each channel's round trips, median and p90 (ms), measured one channel after the other
    between two fresh processes (one thread each)."""
    rows = []
    for channel in a.channels:
        times = spawn_ranks(
            _rank, 2, channel, dataclasses.asdict(a), timeout_s=a.timeout_s, threads=1
        )[0]
        for label, xs in times.items():
            ms = sorted(x * 1e3 for x in xs)
            p90 = statistics.quantiles(ms, n=10, method="inclusive")[-1] if len(ms) > 1 else ms[0]
            rows.append({"channel": channel, "command": label, "n": len(ms),
                         "median_ms": statistics.median(ms), "p90_ms": p90})  # fmt: skip
    return {
        "args": dataclasses.asdict(a),
        "machine": machine_info(),
        "versions": package_versions("pyzmq"),
        "rows": rows,
    }


def format_table(res: dict[str, Any]) -> str:
    a = res["args"]
    widths = (-9, -22, 6, 12, 12)
    lines = [
        f"control channel round trips, 2 processes on this machine ({a['samples']} samples x "
        f"{a['tokens']} tokens per generate answer)",
        columns(("channel", "command", "n", "median ms", "p90 ms"), widths),
    ]
    for r in res["rows"]:
        lines.append(columns((r["channel"], r["command"], r["n"], f"{r['median_ms']:.3f}",
                              f"{r['p90_ms']:.3f}"), widths))  # fmt: skip
    return "\n".join(lines)
