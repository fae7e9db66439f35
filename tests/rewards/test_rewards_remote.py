"""Remote rewards (``reward.name=http://...``) against a server each test starts on the
loopback address, faults injected: order, extra row keys, 503s, dropped connections,
timeouts, retries spent, an unreachable server at start, bad answers."""

from __future__ import annotations

import json
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_grpo.config import ConfigError
from megatron_grpo.config.schema import DataConfig, RewardConfig
from megatron_grpo.rewards import build_reward, check_reward

FILE_DATA = DataConfig(source="x.jsonl")


def _value(response: str) -> float:
    return 2.0 if response == "slow" else float(response)


class RewardServer:
    """A reward server on 127.0.0.1: scores ``float(response)`` per item, after the faults
    set on it: the first ``busy`` requests get a 503, the first ``drop`` have their
    connection closed unanswered, an item whose response is ``"slow"`` is answered after
    ``slow_s``; ``answer`` replaces the whole JSON answer. ``scored`` counts each response
    text a 200 answer carried; ``requests`` counts every request."""

    def __init__(self) -> None:
        self.busy = self.drop = 0
        self.busy_code = 503
        self.slow_s = 0.0
        self.answer: Callable[[list[dict]], object] | None = None
        self.scored: Counter[str] = Counter()
        self.items: list[dict] = []
        self.requests = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as real servers
            disable_nagle_algorithm = True  # see bench/rewards/server.py

            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                items = body["items"]
                with server.lock:
                    server.requests += 1
                    drop = server.drop > 0
                    busy = not drop and server.busy > 0
                    server.drop -= drop
                    server.busy -= busy
                if drop:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if busy:
                    self._send(server.busy_code, b"busy")
                    return
                if any(it["response"] == "slow" for it in items):
                    threading.Event().wait(server.slow_s)
                if server.answer is not None:
                    out = server.answer(items)
                else:
                    out = {"rewards": [_value(it["response"]) for it in items]}
                with server.lock:
                    server.scored.update(it["response"] for it in items)
                    server.items.extend(items)
                self._send(200, json.dumps(out).encode())

            def _send(self, code: int, data: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 64  # the listen backlog: every client connects at once

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def server() -> Iterator[RewardServer]:
    s = RewardServer()
    yield s
    s.close()


def _cfg(url: str, **kw) -> RewardConfig:
    kw = {"concurrency": 4, "batch_size": 3, "retries": 3, "backoff_s": 0.01, **kw}
    return RewardConfig(name=url, **kw)


def _batch(n: int) -> tuple[list[str], list[str], list[str]]:
    return [f"p{i}" for i in range(n)], [str(i) for i in range(n)], ["a"] * n


def test_rewards_come_back_in_order_with_the_rows_extra_keys(server) -> None:
    prompts, responses, answers = _batch(10)
    rows = [{"prompt": "raw", "answer": "gold", "id": i, "tests": ["x"]} for i in range(10)]
    with build_reward(_cfg(server.url), FILE_DATA) as fn:
        rewards, info = fn(prompts, responses, answers, rows=rows)
    assert rewards == [float(i) for i in range(10)]
    assert info["errors"] == info["timeouts"] == 0
    by_id = {it["id"]: it for it in server.items}
    assert sorted(by_id) == list(range(10))
    # the row's own prompt/answer do not replace the scored item's
    assert by_id[4] == {"prompt": "p4", "response": "4", "answer": "a", "id": 4, "tests": ["x"]}
    assert server.requests == 1 + 4  # the start's empty probe, then ceil(10 / 3)


def test_503_for_a_while_then_every_item_scored_once(server) -> None:
    prompts, responses, answers = _batch(24)
    with build_reward(_cfg(server.url, retries=6), FILE_DATA) as fn:
        server.busy = 5  # after the start's probe
        rewards, info = fn(prompts, responses, answers)
        retries = fn._remote.total_retries  # type: ignore[union-attr]
    assert rewards == [float(i) for i in range(24)] and info["errors"] == 0
    assert retries == 5
    assert server.scored == Counter(responses)  # each item scored by the server once


def test_dropped_connections_lose_no_item(server) -> None:
    prompts, responses, answers = _batch(24)
    with build_reward(_cfg(server.url, retries=6), FILE_DATA) as fn:
        server.drop = 5
        rewards, info = fn(prompts, responses, answers)
        again, _ = fn(prompts, responses, answers)  # kept-alive connections are reused
        assert len(fn._remote._conns) <= 4  # type: ignore[union-attr]  # dropped ones forgotten
    assert rewards == again == [float(i) for i in range(24)]
    assert info["errors"] == info["timeouts"] == 0
    assert server.drop == 0 and server.requests == 1 + 8 + 5 + 8  # 5 dropped, sent again
    assert server.scored == Counter(responses * 2)


def test_a_request_past_the_timeout_scores_0_as_timeouts(server) -> None:
    server.slow_s = 3.0
    with build_reward(_cfg(server.url, timeout_s=0.3, batch_size=2), FILE_DATA) as fn:
        rewards, info = fn(["p"] * 4, ["1", "slow", "3", "4"], ["a"] * 4)
    # the slow item's request (items 0 and 1) times out, without a retry
    assert rewards == [0.0, 0.0, 3.0, 4.0]
    assert info["timeouts"] == 2 and info["errors"] == 0 and info["total_timeouts"] == 2


def test_retries_spent_score_0_and_are_counted(server) -> None:
    with build_reward(_cfg(server.url, retries=2, batch_size=2), FILE_DATA) as fn:
        server.busy = 3  # the first request's three tries
        rewards, info = fn(["p"] * 2, ["1", "2"], ["a"] * 2)
        rewards2, info2 = fn(["p"] * 2, ["1", "2"], ["a"] * 2)
    assert rewards == [0.0, 0.0] and info["errors"] == 2 and info["timeouts"] == 0
    assert rewards2 == [1.0, 2.0] and info2["errors"] == 0 and info2["total_errors"] == 2
    assert server.requests == 1 + 3 + 1


@pytest.mark.parametrize(("code", "scored"), [(429, True), (404, False)])
def test_429_is_retried_and_404_is_not(server, code, scored) -> None:
    with build_reward(_cfg(server.url, batch_size=2), FILE_DATA) as fn:
        server.busy, server.busy_code = 1, code
        rewards, info = fn(["p"] * 2, ["1", "2"], ["a"] * 2)
    assert rewards == ([1.0, 2.0] if scored else [0.0, 0.0])
    assert info["errors"] == (0 if scored else 2)
    assert server.requests == 1 + 1 + scored


def test_https_with_a_certificate_the_client_trusts(tmp_path, monkeypatch) -> None:
    import datetime
    import ipaddress
    import ssl

    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(1)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))  # fmt: skip
    server = RewardServer()
    try:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
        server.httpd.socket = ctx.wrap_socket(server.httpd.socket, server_side=True)
        url = server.url.replace("http://", "https://")
        with pytest.raises(ValueError, match="TLS: .*CERTIFICATE_VERIFY_FAILED"):  # untrusted
            check_reward(_cfg(url, retries=5, backoff_s=10.0))  # not retried: no 10 s wait
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "cert.pem"))
        with build_reward(_cfg(url), FILE_DATA) as fn:
            rewards, info = fn(*_batch(5))
        assert rewards == [0.0, 1.0, 2.0, 3.0, 4.0] and info["errors"] == 0
    finally:
        server.close()


@pytest.mark.parametrize(
    "answer",
    [
        lambda items: {"rewards": [1.0] * (len(items) + 1)},  # wrong length
        lambda items: {"scores": [1.0] * len(items)},  # wrong key
        lambda items: {"rewards": ["high"] * len(items)},  # not numbers
        lambda items: "not an object",
    ],
)
def test_a_bad_answer_scores_0_as_errors_without_retrying(server, answer) -> None:
    with build_reward(_cfg(server.url), FILE_DATA) as fn:
        server.answer = answer
        rewards, info = fn(["p"] * 2, ["1", "2"], ["a"] * 2)
    assert rewards == [0.0, 0.0] and info["errors"] == 2
    assert server.requests == 2  # the probe and one try


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_server_is_one_line_at_start() -> None:
    url = f"http://127.0.0.1:{_closed_port()}/score"
    with pytest.raises(ValueError) as e:
        check_reward(_cfg(url, retries=1))
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and url in msg and "start the server" in msg


def test_a_server_that_refuses_the_empty_batch_is_refused_at_start(server) -> None:
    server.answer = lambda items: {"nope": []}
    with pytest.raises(ValueError, match=r'did not answer an empty batch .*"rewards"'):
        check_reward(_cfg(server.url))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"concurrency": 0}, r"reward.concurrency=0 must be > 0"),
        ({"batch_size": 0}, r"reward.batch_size=0 must be > 0"),
        ({"retries": -1}, r"reward.retries=-1 must be >= 0"),
        ({"backoff_s": -1.0}, r"reward.backoff_s=-1.0 must be >= 0"),
    ],
)
def test_bad_remote_settings_name_the_key(kw, match) -> None:
    with pytest.raises(ConfigError, match=match):
        RewardConfig(name="http://127.0.0.1:1/x", **kw)


def test_bad_urls_and_format_weight_are_refused_before_any_request() -> None:
    with pytest.raises(ValueError, match=r"not a usable URL: write http://HOST:PORT/PATH"):
        check_reward(RewardConfig(name="http:///score"))
    with pytest.raises(ValueError, match=r"not a usable URL"):
        check_reward(RewardConfig(name="http://localhost:99999/score"))
    with pytest.raises(ValueError, match=r"format_weight=0.5 .* fold the format into the server"):
        check_reward(RewardConfig(name="http://127.0.0.1:1/x", format_weight=0.5))


def test_the_step_scorer_sends_each_responses_data_row(server) -> None:
    from types import SimpleNamespace

    from megatron_grpo.data.prompts import Prompt
    from megatron_grpo.rewards.scoring import GroupScorer

    class Digits:  # a tokenizer whose token i decodes to the digit i
        def batch_decode(self, ids, skip_special_tokens=True):
            return ["".join(map(str, x)) for x in ids]

    prompts = [Prompt(f"Q{i}:", [1], str(i), row={"question": f"q{i}", "id": 10 + i})
               for i in range(2)]  # fmt: skip
    samples = [SimpleNamespace(response_ids=[i], env_reward=None) for i in (3, 5, 7, 9)]
    with build_reward(_cfg(server.url), FILE_DATA) as fn:
        rewards_PG, info = GroupScorer(fn, Digits(), 2, 8, 0, 0.0)(prompts, samples)
    assert rewards_PG.tolist() == [[3.0, 5.0], [7.0, 9.0]]
    got = sorted((it["id"], it["question"], it["prompt"], it["response"]) for it in server.items)
    assert got == [(10, "q0", "Q0:", "3"), (10, "q0", "Q0:", "5"),
                   (11, "q1", "Q1:", "7"), (11, "q1", "Q1:", "9")]  # fmt: skip
