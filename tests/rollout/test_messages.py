"""The control channel carries data, never code (rollout/messages.py, rollout/control.py):
every message kind round-trips into the project's own types, and a pickle, a malformed, a
truncated or an oversized message under a control key is refused in one line that names the
key and the peer, with nothing in it run."""

from __future__ import annotations

import json
import pickle
import struct

import pytest
import torch.distributed as dist

from megatron_grpo.rollout import messages
from megatron_grpo.rollout.control import TRAINER, Channel, PeerGone, engine_peer
from megatron_grpo.rollout.messages import MAGIC, BadMessage, decode
from megatron_grpo.rollout.samples import Sample

SAMPLES = [
    Sample([5, 6, 7], [8, 2**40, 0], [-0.125, -1e-300, -745.1332191019411], "stop", "3"),
    Sample([5, 6, 7], [], [], "length", None),
    Sample([1], [9], [-0.1 - 0.2], "length", "3"),  # not a short decimal: exact bits must survive
]
GENERATE = dict(prompts=[[5, 6, 7], [1]], engines=2,
                sampling=dict(n=2, temperature=0.7, top_p=1.0, top_k=-1, max_new_tokens=4,
                              stop_token_ids=[3], seed=11))  # fmt: skip


class _Boom:
    """Unpickling this creates ``path``: the proof that a load ran the payload's code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _frame(header: dict, blob: bytes = b"") -> bytes:
    head = json.dumps(header).encode()
    return MAGIC + struct.pack("<Q", len(head)) + head + blob


@pytest.fixture
def ends():
    """``ends(max_bytes)``: trainer rank 0's and engine 0's ends of the channel, in this
    process (a HashStore stands in for the rendezvous store); ``ends.one(name)`` another;
    all closed after the test."""
    store, made = dist.HashStore(), []

    def one(name: str, max_bytes: int = messages.MAX_MESSAGE_BYTES) -> Channel:
        made.append(Channel(store, name, timeout_s=0.3, max_bytes=max_bytes))
        return made[-1]

    def make(max_bytes: int = messages.MAX_MESSAGE_BYTES) -> tuple[Channel, Channel]:
        return one(TRAINER, max_bytes), one(engine_peer(0), max_bytes)

    make.one = one
    yield make
    for ch in made:
        ch.close()


def test_every_message_kind_round_trips():
    got = decode(messages.samples(SAMPLES), "res/0/0", "engine 0", ("samples",))
    assert got.kind == "samples" and got.body == SAMPLES
    assert [type(s) for s in got.body] == [Sample] * 3
    cmds = {
        "generate": GENERATE,
        "init_transfer": dict(
            info=dict(
                master_address="10.0.0.1",
                master_port=29555,
                world_size=3,
                backend="gloo",
                timeout_s=60,
                plan={"model_dir": "/m", "engines": [[2]]},
            ),
            rank_offsets=[2],
        ),  # fmt: skip
        "update": {},
        "stop": {},
    }
    for op, payload in cmds.items():
        m = decode(messages.command(op, **payload), "cmd/0", "trainer", ("command",))
        assert m.body == {"op": op, **payload}
    assert decode(messages.ready(1.5), "ready/0", "e0", ("ready",)).body == {"seconds": 1.5}
    assert decode(messages.reply(version=2), "r", "e0", ("reply",)).body == {"version": 2}
    assert decode(messages.error("x: y"), "r", "e0", ("error",)).body == {"error": "x: y"}
    assert decode(messages.abort("boom"), "abort", "t", ("abort",)).body == "boom"


def test_a_command_that_does_not_fit_its_schema_is_not_sent():
    with pytest.raises(ValueError, match=r"generate.prompts\[0\]\[1\] is str, expected int"):
        messages.command("generate", **dict(GENERATE, prompts=[[1, "2"]]))
    with pytest.raises(ValueError, match=r"generate.sampling has unknown key 'beam'"):
        messages.command("generate", **dict(GENERATE, sampling={"beam": 2}))
    with pytest.raises(ValueError, match="'shell'.*unknown op"):
        messages.command("shell")


def test_a_pickle_under_a_control_key_is_refused_and_runs_nothing(tmp_path, ends):
    armed, marker = tmp_path / "armed", tmp_path / "marker"
    pickle.loads(pickle.dumps(_Boom(str(armed))))
    assert armed.exists()  # the payload is live: loading it with pickle runs its code
    trainer, engine = ends()
    trainer.post(engine.name, "cmd/0", pickle.dumps({"op": "stop", "x": _Boom(str(marker))}))
    with pytest.raises(BadMessage) as err:
        engine.wait("cmd/0", [TRAINER], "command 0 from trainer rank 0", ("command",))
    msg = str(err.value)
    assert "'cmd/0' (command 0 from trainer rank 0) refused: not a megatron-grpo message " in msg
    assert "(a pickle)" in msg and "docs/launch.md" in msg and "\n" not in msg
    assert not marker.exists()


def test_the_server_answers_a_bad_command_with_its_error_and_stops(tmp_path, ends):
    """The rollout rank's loop: the trainer is told why (res/<seq>/<e>), and the rank stops
    rather than serve on after a command it cannot read."""
    from megatron_grpo.rollout.server import _serve_loop

    marker = tmp_path / "marker"
    trainer, engine = ends()
    trainer.post(engine.name, "cmd/0", pickle.dumps(_Boom(str(marker))))
    with pytest.raises(BadMessage, match="'cmd/0'"):
        _serve_loop(None, engine, object(), 0, 1)
    answer = trainer.wait("res/0/0", [], "engine 0's generate, from rank 1", ("reply", "error"))
    assert answer.kind == "error" and answer.body["error"].startswith("BadMessage: control")
    assert not marker.exists()


def _samples_raw() -> bytes:
    return messages.samples(SAMPLES)


def _header_len() -> int:
    return struct.unpack_from("<Q", _samples_raw(), len(MAGIC))[0]


BAD = {
    "empty": (lambda: b"", "not a megatron-grpo message"),
    "other magic": (lambda: b"GET / HTTP/1.1\r\n", "not a megatron-grpo message"),
    "truncated header": (lambda: _samples_raw()[: len(MAGIC) + 20], "truncated"),
    "truncated arrays": (lambda: _samples_raw()[:-5], "truncated: array 'logprobs'"),
    "trailing bytes": (lambda: _samples_raw() + b"\0", "1 bytes after its last array"),
    "not json": (lambda: MAGIC + struct.pack("<Q", 3) + b"{x]", "header is not JSON"),
    "NaN": (
        lambda: _frame({"kind": "ready", "body": {"seconds": float("nan")}, "arrays": []}),
        "NaN is not a number",
    ),  # fmt: skip
    "nested": (
        lambda: MAGIC + struct.pack("<Q", 200000) + b"[" * 100000 + b"]" * 100000,
        "header is not JSON",
    ),  # fmt: skip
    "unknown kind": (
        lambda: _frame({"kind": "exec", "body": "x", "arrays": []}),
        "unknown kind 'exec'",
    ),  # fmt: skip
    "wrong kind here": (lambda: messages.samples(SAMPLES), "a 'samples' message where command"),
    "unknown op": (
        lambda: _frame({"kind": "command", "body": {"op": "rm"}, "arrays": []}),
        "unknown command op 'rm'",
    ),  # fmt: skip
    "extra key": (
        lambda: _frame({"kind": "command", "body": {"op": "stop", "cb": 1}, "arrays": []}),
        "stop has unknown key 'cb'",
    ),  # fmt: skip
    "wrong type": (
        lambda: _frame(
            {
                "kind": "command",
                "body": {**GENERATE, "op": "generate", "engines": "2"},
                "arrays": [],
            }
        ),
        "generate.engines is str, expected int",
    ),  # fmt: skip
    "arrays on a command": (
        lambda: _frame({"kind": "command", "body": {"op": "stop"}, "arrays": [["x", "object", 1]]}),
        "arrays",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_and_truncated_messages_are_one_clear_line(case, ends):
    make, why = BAD[case]
    trainer, engine = ends()
    trainer.post(engine.name, "cmd/4", make())
    with pytest.raises(BadMessage) as err:
        engine.wait("cmd/4", [], "command 4 from trainer rank 0", ("command",))
    msg = str(err.value)
    assert msg.startswith("control message 'cmd/4' (command 4 from trainer rank 0) refused: ")
    assert why in msg and "\n" not in msg, msg


def test_samples_carry_their_routed_experts():
    """rollout.routing_replay: each sample's [prompt + response - 1, layers, k] experts travel
    as one raw uint8 (or int16) array; a count that does not add up is refused."""
    import dataclasses

    import numpy as np

    batch = [dataclasses.replace(s, routed_experts=np.arange(
        (len(s.prompt_ids) + len(s.response_ids) - 1) * 4, dtype=np.uint8).reshape(-1, 2, 2))
        for s in SAMPLES]  # fmt: skip
    raw = messages.samples(batch)
    got = decode(raw, "res/0/0", "engine 0", ("samples",)).body
    for a, b in zip(got, batch):
        assert np.array_equal(a.routed_experts, b.routed_experts)
        assert (a.prompt_ids, a.response_ids, a.logprobs) == (
            b.prompt_ids,
            b.response_ids,
            b.logprobs,
        )
    assert (
        len(raw) - len(messages.samples(SAMPLES)) < sum(r.routed_experts.size for r in batch) + 80
    )
    n = struct.unpack_from("<Q", raw, len(MAGIC))[0]
    header = json.loads(raw[len(MAGIC) + 8 : len(MAGIC) + 8 + n])
    header["arrays"][3][2] -= 1  # one expert id short (the routed array comes last)
    with pytest.raises(BadMessage, match="routed experts, expected"):
        decode(_frame(header, raw[len(MAGIC) + 8 + n : -1]), "res/0/0", "e", ("samples",))


@pytest.mark.parametrize(
    "body, arrays, why",
    [
        ({"prompt_len": [3], "response_len": [2], "finish_reason": ["stop"],
          "weight_version": ["1"]}, (3, 2, 1), "1 logprobs for 2 response tokens"),
        ({"prompt_len": [3], "response_len": [5], "finish_reason": ["stop"],
          "weight_version": ["1"]}, (3, 2, 2), "response_len sums to 5, response_ids holds 2"),
        ({"prompt_len": [3, 0], "response_len": [2], "finish_reason": ["stop"],
          "weight_version": ["1"]}, (3, 2, 2), "lengths differ"),
        ({"prompt_len": [3], "response_len": [2], "finish_reason": ["eval"],
          "weight_version": ["1"]}, (3, 2, 2), "finish_reason 'eval'"),
        ({"prompt_len": [3], "response_len": [2], "finish_reason": ["stop"],
          "weight_version": [1]}, (3, 2, 2), "samples.weight_version[0] is int, expected str"),
    ],
)  # fmt: skip
def test_samples_that_do_not_add_up_are_refused(body, arrays, why):
    names = [("prompt_ids", "int64"), ("response_ids", "int64"), ("logprobs", "float64")]
    header = {"kind": "samples", "body": body,
              "arrays": [[n, d, c] for (n, d), c in zip(names, arrays)]}  # fmt: skip
    raw = _frame(header, b"\0" * 8 * sum(arrays))
    with pytest.raises(BadMessage) as err:
        decode(raw, "res/0/1", "engine 1's generate", ("samples",))
    assert str(err.value).startswith("control message 'res/0/1' (engine 1's generate) refused: ")
    assert why in str(err.value)


def test_oversized_messages_are_neither_sent_nor_read(ends):
    raw = messages.samples(SAMPLES)
    trainer, engine = ends(max_bytes=len(raw) - 1)
    with pytest.raises(ValueError, match=f"'res/0/0' not sent: {len(raw)} bytes, over the limit "
                       f"of {len(raw) - 1} .*rollout.num_engines"):  # fmt: skip
        engine.post(TRAINER, "res/0/0", raw)
    with pytest.raises(PeerGone, match="waited 0s"):  # nothing arrived
        trainer.wait("res/0/0", [], "engine 0", ("samples",))
    larger = ends.one(engine_peer(1))  # a peer with a larger limit
    larger.post(TRAINER, "res/0/0", raw)
    with pytest.raises(BadMessage, match=f"'res/0/0' \\(engine 0\\) refused: {len(raw)} bytes"):
        trainer.wait("res/0/0", [], "engine 0", ("samples",))
    assert messages.MAX_MESSAGE_BYTES == 1 << 30
