"""The control channel (rollout/control.py): a wait ends in a message, or in ``PeerGone``
naming the peer that stopped beating (died, hung, never started) or the abort's reason;
frames without the job's token are dropped; closing leaves no thread and no socket."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist
import zmq

from megatron_grpo.config.schema import ParallelConfig
from megatron_grpo.distributed.spawn import free_port
from megatron_grpo.rollout import control, messages
from megatron_grpo.rollout.control import TRAINER, Channel, PeerGone, engine_peer


@pytest.fixture
def store():
    return dist.HashStore()


@pytest.fixture
def opened(store):
    """``opened(name, timeout_s)``: a channel on ``store``, closed after the test."""
    made = []

    def one(name: str, timeout_s: float = 0.3) -> Channel:
        made.append(Channel(store, name, timeout_s=timeout_s))
        return made[-1]

    yield one
    for ch in made:
        ch.close()


def test_a_wait_gives_up_on_a_silent_peer_and_on_abort(opened):
    ch = opened(engine_peer(0))
    t0 = time.monotonic()
    with pytest.raises(PeerGone, match="heartbeat 'hb/trainer' stopped"):
        ch.wait("cmd/0", [TRAINER], "command 0", ("command",))
    assert time.monotonic() - t0 < 5
    trainer = opened(TRAINER)
    trainer.post(ch.name, "abort", messages.abort("trainer rank 0 failed to start: boom"))
    with pytest.raises(PeerGone, match="gave up waiting for command 0: .*boom"):
        ch.wait("cmd/0", [TRAINER], "command 0", ("command",))
    trainer.post(ch.name, "cmd/1", messages.command("stop"))
    assert ch.wait("cmd/1", [], "command 1", ("command",)).body == {"op": "stop"}
    with pytest.raises(PeerGone, match="waited 0s .* for command 1"):  # taken: gone
        ch.wait("cmd/1", [], "command 1", ("command",))


def test_a_beating_peer_keeps_a_wait_alive_past_the_timeout(opened, monkeypatch):
    monkeypatch.setattr(control, "_HEARTBEAT_S", 0.05)
    engine, trainer = opened(engine_peer(0)), opened(TRAINER)
    trainer.beat_forever([engine.name])
    later = threading.Timer(1.0, trainer.post, (engine.name, "cmd/0", messages.command("stop")))
    later.start()
    try:
        t0 = time.monotonic()
        got = engine.wait("cmd/0", [TRAINER], "command 0", ("command",))
        assert got.body == {"op": "stop"} and time.monotonic() - t0 > 0.9  # 3x timeout_s
    finally:
        later.join()


def test_messages_arrive_in_any_order_and_are_kept_by_key(opened):
    trainer, e0, e1 = opened(TRAINER), opened(engine_peer(0)), opened(engine_peer(1))
    e1.post(TRAINER, "res/0/1", messages.reply(version=1))
    e0.post(TRAINER, "res/0/0", messages.reply(version=0))
    for e in (0, 1):
        got = trainer.wait(f"res/0/{e}", [engine_peer(e)], f"engine {e}", ("reply",))
        assert got.body == {"version": e}


def test_a_frame_without_the_job_token_is_dropped(opened, caplog):
    """A process that reaches the port but never read the rendezvous store: its frames
    are dropped with a warning, and the wait goes on to the real message."""
    engine, trainer = opened(engine_peer(0)), opened(TRAINER)
    address = engine.store.get(f"inbox/{engine.name}").decode().split()[0]
    ctx = zmq.Context()
    stranger = ctx.socket(zmq.PUSH)
    stranger.setsockopt(zmq.LINGER, 1000)
    stranger.connect(address)
    stranger.send_multipart([b"0" * 16, TRAINER.encode(), b"cmd/0", messages.command("stop")])
    stranger.send(b"one frame")
    stranger.close()
    ctx.term()
    with caplog.at_level(logging.WARNING, "megatron_grpo.rollout.control"):
        with pytest.raises(PeerGone):
            engine.wait("cmd/0", [], "command 0", ("command",))
    assert caplog.text.count("without this job's token") == 2, caplog.text
    trainer.post(engine.name, "cmd/0", messages.command("update"))
    assert engine.wait("cmd/0", [], "command 0", ("command",)).body == {"op": "update"}


def test_a_peer_that_never_published_its_address_is_gone(opened):
    trainer = opened(TRAINER)
    with pytest.raises(PeerGone, match="'engine/3' to publish its control address .* never"):
        trainer.post(engine_peer(3), "cmd/0", messages.command("stop"))


def test_close_stops_the_heartbeat_and_closes_every_socket(opened):
    engine, trainer = opened(engine_peer(0)), opened(TRAINER)
    trainer.beat_forever([engine.name])
    trainer.post(engine.name, "cmd/0", messages.command("stop"))
    assert any(t.name == "heartbeat-trainer" for t in threading.enumerate())
    trainer.close()
    trainer.close()  # idempotent
    assert not any(t.name.startswith("heartbeat-") for t in threading.enumerate())
    assert trainer._ctx.closed and trainer._inbox.closed
    assert engine.wait("cmd/0", [], "command 0", ("command",)).body == {"op": "stop"}


_PEER = """
import sys, time
import torch.distributed as dist
from megatron_grpo.rollout import control, messages
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False)
ch = control.Channel(store, control.engine_peer(0), timeout_s=60.0)
ch.beat_forever([control.TRAINER])
ch.post(control.TRAINER, "ready/0", messages.ready(0.0))
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["hung", "dead"])
def test_a_hung_or_dead_peer_process_ends_the_wait(how):
    """Issue 46's goal, measured: a driver process stopped (SIGSTOP: its heartbeat thread
    stops too) or killed (SIGKILL) is noticed by trainer rank 0's wait for its answer through
    the heartbeat, within parallel.heartbeat_timeout_s at its default (10 s), with
    parallel.timeout_s at its default (600 s) far away; the figure is printed."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True)
    defaults = ParallelConfig()
    trainer = Channel(store, TRAINER, timeout_s=defaults.timeout_s,
                      silent_s=defaults.heartbeat_timeout_s)  # fmt: skip
    peer = subprocess.Popen([sys.executable, "-c", _PEER, str(port)], env=os.environ)
    try:
        ready = trainer.wait("ready/0", [engine_peer(0)], "engine 0 to start", ("ready",))
        assert ready.kind == "ready"
        os.kill(peer.pid, signal.SIGSTOP if how == "hung" else signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(PeerGone, match=r"waited 10s \(parallel.heartbeat_timeout_s\) for "
                           "engine 0's generate, and heartbeat 'hb/engine/0' stopped: that "
                           "process died"):  # fmt: skip
            trainer.wait("res/0/0", [engine_peer(0)], "engine 0's generate", ("samples",))
        noticed = time.monotonic() - t0
        print(f"{how} engine noticed {noticed:.2f}s after the signal "
              f"(heartbeat_timeout_s={defaults.heartbeat_timeout_s:g})")  # fmt: skip
        assert noticed <= defaults.heartbeat_timeout_s + 2.0  # the wait wakes at its due time
    finally:
        peer.kill()
        peer.wait(timeout=30)
        trainer.close()


def test_an_abort_from_any_trainer_rank_reaches_every_rollout_rank(store, monkeypatch):
    """Trainer rank 1 failed to start: its one-off channel tells the driver and the other
    rank of engine 0 (tp 2); trainer rank 0's channel, already closed by a stop, sends none."""
    from megatron_grpo.distributed.placement import RankPlacement
    from megatron_grpo.rollout.server import DisaggregatedWorld, peer_name

    monkeypatch.setenv("MEGATRON_GRPO_CONTROL_ADDR", "127.0.0.1")
    placement = RankPlacement("disaggregated", 4, [0, 1], [2, 3], [[2, 3]])
    assert [peer_name(r, placement) for r in range(4)][::2] == [TRAINER, engine_peer(0)]
    ranks = [Channel(store, peer_name(r, placement), timeout_s=0.3) for r in (2, 3)]
    try:
        DisaggregatedWorld(1, placement, store, 0.3).abort("trainer rank 1 failed: boom")
        for ch in ranks:
            with pytest.raises(PeerGone, match="gave up waiting for command 0: .*boom"):
                ch.wait("cmd/0", [TRAINER], "command 0", ("command",))
        closed = Channel(store, TRAINER, timeout_s=0.3)
        closed.close()
        DisaggregatedWorld(0, placement, store, 0.3, closed).abort("after stop")
    finally:
        for ch in ranks:
            ch.close()
    assert ranks[1].name == "rank/3"


@pytest.mark.timeout(60)
def test_a_peer_that_stops_beating_is_gone_after_heartbeat_timeout_not_timeout_s(store):
    """parallel.heartbeat_timeout_s: a dead engine (heard from, then silent) ends the
    trainer's wait after that many seconds, not after parallel.timeout_s (here 600 s, past
    this test's timeout). At the defaults (beats every 2 s, 10 s) a dead engine is noticed
    within 10 s of its last beat; the figure is printed."""
    trainer = Channel(store, TRAINER, timeout_s=600, silent_s=1.0)
    engine = Channel(store, engine_peer(0), timeout_s=600)
    try:
        engine.beat_forever([TRAINER])
        engine.post(TRAINER, "res/0/0", messages.reply(version=0))
        assert trainer.wait("res/0/0", [engine.name], "engine 0", ("reply",)).body == {"version": 0}
        engine.stop_beating()  # the engine process dies: no frame from now on
        t0 = time.monotonic()
        with pytest.raises(PeerGone, match=r"waited 1s \(parallel.heartbeat_timeout_s\) for "
                           "engine 0's reply, and heartbeat 'hb/engine/0' stopped"):  # fmt: skip
            trainer.wait("res/1/0", [engine.name], "engine 0's reply", ("reply",))
        print(f"dead engine noticed {time.monotonic() - t0:.2f}s after its last beat "
              "(heartbeat_timeout_s=1)")  # fmt: skip
    finally:
        trainer.close()
        engine.close()
