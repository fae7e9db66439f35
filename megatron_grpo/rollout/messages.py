"""What the processes of the disaggregated placement say to each other over the control
channel (rollout/control.py, ZeroMQ): data, never code. A message is one frame, JSON (its kind and
body) then raw little-endian int64/float64 arrays (the samples' token ids and log-probs), decoded
into the project's own types and checked on arrival (keys, types, lengths); with routing
replay the samples' routed experts follow as one uint8 or int16 array. Anything else,
a pickle included, is refused with one line naming the key and the peer; nothing in a message
is ever called or imported. Why, and what the rendezvous port exposes: docs/launch.md.
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_grpo.rollout.samples import Sample

MAGIC = b"mgrpo-ctl/1\n"
"""The first bytes of every message (a pickle starts with b"\\x80")."""
MAX_MESSAGE_BYTES = 1 << 30
"""The largest message either side sends or reads (1 GiB): one engine's share of a step's
samples costs 16 bytes per response token (int64 id, float64 log-prob) plus 8 per prompt
token, so 1 GiB is ~60M sampled tokens per engine per step."""
_LEN = struct.Struct("<Q")
_ARRAY_CODES = {"int64": "q", "float64": "d", "uint8": "B", "int16": "h"}
_FIX = (
    "the peer runs another megatron-grpo version, or something other than this job posted it "
    "with the token it read from the rendezvous store: keep the store's port private "
    "(docs/launch.md, 'The rendezvous port')"
)


class BadMessage(RuntimeError):
    """A control message that is not one this version of megatron-grpo sends."""


@dataclass(frozen=True)
class Message:
    """A decoded message: ``kind`` is one of ``SCHEMAS``; ``body`` is checked against it
    (``samples``: a ``list[Sample]``)."""

    kind: str
    body: Any


# ------------------------------------------------------------------------------ schemas
class Opt:
    """A schema that also accepts None; as a dict value, the key may be absent."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner


_SAMPLING = {
    k: Opt(t)
    for k, t in dict(
        n=int,
        temperature=float,
        top_p=float,
        top_k=int,
        max_new_tokens=int,
        seed=int,
        stop_token_ids=[int],
        seeds=[int],
        stop=[str],
    ).items()
}
"""``RolloutEngine.generate``'s keywords (``rollout.interface.sampling_args`` and a seed)."""
COMMANDS = {
    "generate": {
        "op": str,
        "prompts": [[int]],
        "engines": int,
        "sampling": _SAMPLING,
        "rows": Opt([dict]),  # multi-turn episodes' data rows (env.name), one per prompt
    },
    "init_transfer": {
        "op": str,
        "info": {
            "master_address": str,
            "master_port": int,
            "world_size": int,
            "backend": str,
            "timeout_s": float,
            "plan": dict,
        },
        "rank_offsets": [int],
    },
    "update": {"op": str},
    "stop": {"op": str},
}
"""Trainer rank 0 -> the engines' ranks, under ``cmd/<seq>`` (the plan is checked where it is
read, ``bridge.transfer_group.PlanInputs.from_dict``)."""
SCHEMAS: dict[str, Any] = {
    "abort": str,
    "command": dict,  # then by its op: COMMANDS
    "ready": {"seconds": float},
    "reply": {"ok": Opt(bool), "version": Opt(int)},
    "error": {"error": str},
    "samples": {
        "prompt_len": [int],
        "response_len": [int],
        "finish_reason": [str],
        "weight_version": [Opt(str)],
        "routed_shape": Opt([int]),
        "episode": Opt(
            {"turns": [int], "env_reward": [Opt(float)], "env_end": [str], "env_calls": [int]}
        ),
    },
}
_SAMPLE_ARRAYS = (("prompt_ids", "int64"), ("response_ids", "int64"), ("logprobs", "float64"))
_ROUTED_DTYPES = ("uint8", "int16")
_OPTIONAL_ARRAYS = (("routed_experts", _ROUTED_DTYPES), ("response_mask", ("uint8",)))
"""Arrays after the three of every sample, in this order when present."""
"""``Sample.routed_experts`` (rollout.routing_replay): every sample's [prompt + response - 1,
layers, top-k] rows end to end, ``routed_shape`` = [layers, top-k] in the body."""


def _check(value: Any, schema: Any, path: str) -> str | None:
    """What is wrong with ``value`` against ``schema`` (None: nothing)."""
    if isinstance(schema, Opt):
        return None if value is None else _check(value, schema.inner, path)
    if isinstance(schema, list):
        if not isinstance(value, list):
            return f"{path} is {type(value).__name__}, expected a list"
        return next(
            (w for i, v in enumerate(value) if (w := _check(v, schema[0], f"{path}[{i}]"))), None
        )
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return f"{path} is {type(value).__name__}, expected an object"
        unknown = sorted(set(value) - set(schema))
        if unknown:
            return f"{path} has unknown key {unknown[0]!r} (known: {sorted(schema)})"
        for k, s in schema.items():
            if k not in value:
                if not isinstance(s, Opt):
                    return f"{path} lacks key {k!r}"
            elif w := _check(value[k], s, f"{path}.{k}"):
                return w
        return None
    ok = isinstance(value, schema) and not (isinstance(value, bool) and schema is not bool)
    if schema is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    return None if ok else f"{path} is {type(value).__name__}, expected {schema.__name__}"


# ------------------------------------------------------------------------------ encode
def _frame(kind: str, body: Any, arrays: Sequence[tuple[str, str, Sequence[Any]]] = ()) -> bytes:
    blobs = []
    for _, dtype, values in arrays:
        a = array(_ARRAY_CODES[dtype], values)
        if sys.byteorder == "big":
            a.byteswap()
        blobs.append(a.tobytes())
    header = {"kind": kind, "body": body, "arrays": [[n, d, len(v)] for n, d, v in arrays]}
    head = json.dumps(header, allow_nan=False, separators=(",", ":")).encode()
    return b"".join([MAGIC, _LEN.pack(len(head)), head, *blobs])


def abort(reason: str) -> bytes:
    return _frame("abort", str(reason))


def command(op: str, **payload: Any) -> bytes:
    body = {"op": op, **payload}
    why = f"unknown op (known: {sorted(COMMANDS)})" if op not in COMMANDS else None
    if why := why or _check(body, COMMANDS[op], op):
        raise ValueError(f"command {op!r} does not fit rollout/messages.py COMMANDS: {why}")
    return _frame("command", body)


def ready(seconds: float) -> bytes:
    return _frame("ready", {"seconds": float(seconds)})


def reply(**fields: Any) -> bytes:
    return _frame("reply", fields)


def error(text: str) -> bytes:
    return _frame("error", {"error": str(text)})


def samples(batch: list[Sample]) -> bytes:
    """One engine's samples: lengths, finish reasons and versions as JSON, the token ids and
    log-probs as raw arrays (float64: exactly the log-probs vLLM returned)."""
    body = {
        "prompt_len": [len(s.prompt_ids) for s in batch],
        "response_len": [len(s.response_ids) for s in batch],
        "finish_reason": [s.finish_reason for s in batch],
        "weight_version": [s.weight_version for s in batch],
    }
    flat: dict[str, list[int] | list[float]] = {
        "prompt_ids": [t for s in batch for t in s.prompt_ids],
        "response_ids": [t for s in batch for t in s.response_ids],
        "logprobs": [float(x) for s in batch for x in s.logprobs],
    }
    arrays = [(n, d, flat[n]) for n, d in _SAMPLE_ARRAYS]
    if batch and batch[0].routed_experts is not None:
        rows = [s.routed_experts for s in batch]
        body["routed_shape"] = list(rows[0].shape[1:])
        dtype = "uint8" if all(r.dtype.name == "uint8" for r in rows) else "int16"
        arrays.append(("routed_experts", dtype, [int(x) for r in rows for x in r.reshape(-1)]))
    if batch and batch[0].response_mask is not None:  # multi-turn episodes
        body["episode"] = {
            "turns": [s.turns for s in batch],
            "env_reward": [s.env_reward for s in batch],
            "env_end": [s.env_end for s in batch],
            "env_calls": [s.env_calls for s in batch],
        }
        arrays.append(("response_mask", "uint8", [m for s in batch for m in s.response_mask or []]))
    return _frame("samples", body, arrays)


# ------------------------------------------------------------------------------ decode
def decode(
    raw: bytes | memoryview,
    key: str,
    peer: str,
    expect: tuple[str, ...],
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> Message:
    """The message in ``raw``, read from ``key`` (``peer``: who wrote it, for what), checked
    against its kind's schema and against the kinds ``expect``-ed there; raises ``BadMessage``
    naming the key, the peer and what is wrong."""
    if len(raw) > max_bytes:
        raise BadMessage(f"control message {key!r} ({peer}) refused: {too_large(raw, max_bytes)}")
    try:
        m = _decode(bytes(raw))
        if m.kind not in expect:
            raise BadMessage(f"a {m.kind!r} message where {' or '.join(expect)} belongs")
        return m
    except BadMessage as e:
        raise BadMessage(f"control message {key!r} ({peer}) refused: {e}; {_FIX}.") from None


def too_large(data: bytes | memoryview, max_bytes: int) -> str:
    """Why a message of ``data``'s size is refused, and what to change."""
    return (
        f"{len(data)} bytes, over the limit of {max_bytes} (rollout/messages.py "
        "MAX_MESSAGE_BYTES): generate fewer tokens per engine per step (fewer prompts or "
        "samples per step, a smaller rollout.max_new_tokens) or serve with more engines "
        "(rollout.num_engines)."
    )


def _decode(raw: bytes) -> Message:
    if not raw.startswith(MAGIC):
        what = "a pickle" if raw[:1] == b"\x80" else f"starts {raw[:12]!r}"
        raise BadMessage(f"not a megatron-grpo message ({what})")
    at = len(MAGIC) + _LEN.size
    if len(raw) < at or len(raw) < at + (n := _LEN.unpack_from(raw, len(MAGIC))[0]):
        raise BadMessage(f"truncated: {len(raw)} bytes, shorter than its header says")
    try:
        header = json.loads(raw[at : at + n], parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise BadMessage(f"its header is not JSON ({type(e).__name__}: {e})") from None
    frame = {"kind": str, "body": Opt(object), "arrays": [list]}
    if why := _check(header, frame, "header"):
        raise BadMessage(why)
    kind, body = header["kind"], header.get("body")
    if kind not in SCHEMAS:
        raise BadMessage(f"unknown kind {kind!r} (known: {sorted(SCHEMAS)})")
    if why := _check(body, SCHEMAS[kind], kind):
        raise BadMessage(why)
    if kind == "command":
        op = body.get("op")
        if op not in COMMANDS:
            raise BadMessage(f"unknown command op {op!r} (known: {sorted(COMMANDS)})")
        if why := _check(body, COMMANDS[op], op):
            raise BadMessage(why)
    arrays = _arrays(header["arrays"], raw[at + n :], kind)
    if kind == "samples":
        return Message(kind, _samples(body, arrays))
    return Message(kind, body)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number this protocol sends")


def _arrays(specs: list, blob: bytes, kind: str) -> dict[str, list]:
    """The raw arrays after the header, by name: exactly those ``kind`` carries."""
    want = list(_SAMPLE_ARRAYS) if kind == "samples" else []
    for name, dtypes in _OPTIONAL_ARRAYS if kind == "samples" else ():
        at = len(want)  # each optional array in its order, when present
        if (
            len(specs) > at
            and len(specs[at]) >= 2
            and specs[at][0] == name
            and specs[at][1] in dtypes
        ):
            want.append(tuple(specs[at][:2]))
    if [tuple(s[:2]) for s in specs] != want or any(len(s) != 3 for s in specs):
        raise BadMessage(f"arrays {[s[:2] for s in specs]}, expected {[list(w) for w in want]}")
    out, pos = {}, 0
    for name, dtype, count in specs:
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise BadMessage(f"array {name!r} has count {count!r}")
        a = array(_ARRAY_CODES[dtype])
        end = pos + count * a.itemsize
        if end > len(blob):
            raise BadMessage(f"truncated: array {name!r} needs {end} bytes, {len(blob)} arrived")
        a.frombytes(blob[pos:end])
        if sys.byteorder == "big":
            a.byteswap()
        out[name], pos = a.tolist(), end
    if pos != len(blob):
        raise BadMessage(f"{len(blob) - pos} bytes after its last array")
    return out


def _samples(body: dict, arrays: dict[str, list]) -> list[Sample]:
    n = len(body["prompt_len"])
    routed = _routed(body, arrays)
    episode = body.get("episode")
    if any(len(body[k]) != n for k in body if k not in ("routed_shape", "episode")) or (
        episode is not None and any(len(v) != n for v in episode.values())
    ):
        raise BadMessage(f"samples: lengths differ { ({k: len(v) for k, v in body.items()}) }")
    for k, total in (("prompt_len", "prompt_ids"), ("response_len", "response_ids")):
        if any(x < 0 for x in body[k]) or sum(body[k]) != len(arrays[total]):
            raise BadMessage(
                f"samples: {k} sums to {sum(body[k])}, {total} holds {len(arrays[total])}"
            )
    if (episode is None) != ("response_mask" not in arrays) or len(
        arrays.get("response_mask", arrays["response_ids"])
    ) != len(arrays["response_ids"]):
        raise BadMessage("samples: an episode's response_mask and its turns come together, "
                         "one mask entry per response token")  # fmt: skip
    if len(arrays["logprobs"]) != len(arrays["response_ids"]):
        raise BadMessage(
            f"samples: {len(arrays['logprobs'])} logprobs for "
            f"{len(arrays['response_ids'])} response tokens"
        )
    if bad := set(body["finish_reason"]) - {"length", "stop"}:
        raise BadMessage(f"samples: finish_reason {sorted(bad)[0]!r}, expected length or stop")
    out, p, r = [], 0, 0
    for i in range(n):
        pl, rl = body["prompt_len"][i], body["response_len"][i]
        out.append(Sample(arrays["prompt_ids"][p : p + pl], arrays["response_ids"][r : r + rl],
                          arrays["logprobs"][r : r + rl], body["finish_reason"][i],
                          weight_version=body["weight_version"][i]))  # fmt: skip
        if routed is not None:
            out[-1].routed_experts, routed = routed[: pl + rl - 1], routed[pl + rl - 1 :]
        if episode is not None:
            out[-1].response_mask = arrays["response_mask"][r : r + rl]
            out[-1].turns, out[-1].env_reward = episode["turns"][i], episode["env_reward"][i]
            out[-1].env_end, out[-1].env_calls = episode["env_end"][i], episode["env_calls"][i]
        p, r = p + pl, r + rl
    return out


def _routed(body: dict, arrays: dict[str, list]):
    """The samples' routed-experts rows end to end, [rows, layers, top-k] (numpy), or None."""
    shape = body.get("routed_shape")
    if shape is None and "routed_experts" not in arrays:
        return None
    import numpy as np

    rows = sum(pl + rl - 1 for pl, rl in zip(body["prompt_len"], body["response_len"]))
    if shape is None or len(shape) != 2 or min(shape) < 1 or "routed_experts" not in arrays:
        raise BadMessage(f"samples: routed_shape {shape} without routed_experts, or the reverse")
    if len(arrays["routed_experts"]) != rows * shape[0] * shape[1]:
        raise BadMessage(
            f"samples: {len(arrays['routed_experts'])} routed experts, expected "
            f"{rows} rows x {shape[0]} layers x {shape[1]}"
        )
    return np.asarray(arrays["routed_experts"], dtype=np.int16).reshape(rows, *shape)
