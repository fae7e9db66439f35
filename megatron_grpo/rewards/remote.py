"""A reward served over HTTP: ``reward.name=http://HOST:PORT/PATH`` (or ``https://``).

Protocol, retries and failures: docs/rewards-and-data.md, "Remote rewards". A batch is cut
into requests of ``reward.batch_size`` items, ``reward.concurrency`` of them in flight on a
thread pool; each request is retried on its own and its rewards are placed by the items'
indices, so a dropped connection or a 503 never loses an item or scores one twice.
"""

from __future__ import annotations

import http.client
import json
import logging
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from megatron_grpo.rewards.pool import Outcome

log = logging.getLogger(__name__)

SCHEMES = ("http://", "https://")
_RESERVED = ("prompt", "response", "answer")


def is_remote(name: str) -> bool:
    """Whether ``reward.name`` names a remote reward (an http(s) URL)."""
    return name.lower().startswith(SCHEMES)


class _Failed(Exception):
    """A request that will not be retried (a bad answer, a 4xx); ``status`` is the
    :class:`Outcome` status its items get."""

    def __init__(self, detail: str, status: str = "error") -> None:
        super().__init__(detail)
        self.status = status


class _Retryable(Exception):
    """A connection error, a 5xx or a 429: the same request is sent again after a back-off."""


def check_url(url: str) -> tuple[str, str, int, str]:
    """``(scheme, host, port, path)`` of ``url``; ValueError (one line) when it has no host
    or a bad port."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if not parts.hostname or port == -1:
        raise ValueError(
            f"reward.name={url!r} is not a usable URL: write http://HOST:PORT/PATH (or https)."
        )
    scheme = parts.scheme.lower()
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return scheme, parts.hostname, port or (443 if scheme == "https" else 80), path


class RemoteReward:
    """Scores ``(prompt, response, answer)`` items, with their data rows' extra keys, on
    the server at ``url``. ``map`` never raises for a failure of the server: an item whose
    request failed gets an ``Outcome`` of ``error`` (retries spent, a bad answer) or
    ``timeout`` (no answer within ``timeout_s``)."""

    def __init__(self, url: str, timeout_s: float, concurrency: int, batch_size: int,
                 retries: int, backoff_s: float) -> None:  # fmt: skip
        self.url = url
        self.scheme, self.host, self.port, self.path = check_url(url)
        self.timeout_s, self.concurrency, self.batch_size = timeout_s, concurrency, batch_size
        self.retries, self.backoff_s = retries, backoff_s
        self.total_retries = 0  # requests sent again, over the run
        self._local = threading.local()  # one kept-alive connection per pool thread
        self._conns: list[http.client.HTTPConnection] = []
        self._conns_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._logged_retry = False

    # ------------------------------------------------------------------ one request
    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self.scheme == "https":
                conn = http.client.HTTPSConnection(
                    self.host, self.port, timeout=self.timeout_s,
                    context=ssl.create_default_context(),
                )  # fmt: skip
            else:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
            with self._conns_lock:
                self._conns.remove(conn)

    def _post_once(self, body: bytes, n: int) -> list[float]:
        """One POST; the ``n`` rewards it answered. Raises :class:`_Retryable` or
        :class:`_Failed`."""
        conn = self._connection()
        reused = conn.sock is not None
        t0 = time.monotonic()
        try:
            conn.request("POST", self.path, body=body,
                         headers={"Content-Type": "application/json"})  # fmt: skip
            resp = conn.getresponse()
            data = resp.read()
        except TimeoutError as e:
            self._drop_connection()
            raise _Failed(f"no answer within reward.timeout_s={self.timeout_s}s", "timeout") from e
        except ssl.SSLError as e:  # an untrusted certificate stays untrusted: no retry
            self._drop_connection()
            raise _Failed(f"TLS: {e}") from e
        except (OSError, http.client.HTTPException) as e:  # refused, reset, dropped
            self._drop_connection()
            if reused:  # the server closed a kept-alive connection: a fresh one, at once
                return self._post_once(body, n)
            raise _Retryable(f"{type(e).__name__}: {e}") from e
        took = time.monotonic() - t0
        if resp.status >= 500 or resp.status == 429:  # a server down or busy for a while
            raise _Retryable(f"HTTP {resp.status}")
        if resp.status >= 300:
            raise _Failed(f"HTTP {resp.status}: {data[:200]!r}")
        if took > self.timeout_s:  # each socket read was in time, the whole answer was not
            raise _Failed(f"answered in {took:.2f}s > reward.timeout_s={self.timeout_s}s",
                          "timeout")  # fmt: skip
        try:
            rewards = json.loads(data)["rewards"]
            values = [float(r) for r in rewards]
        except (ValueError, TypeError, KeyError) as e:
            raise _Failed(f'answer is not {{"rewards": [float, ...]}}: {data[:200]!r}') from e
        if len(values) != n:
            raise _Failed(f"{len(values)} rewards for {n} items")
        return values

    def _post(self, body: bytes, n: int, log_retry: bool = True) -> list[float]:
        """``_post_once`` with up to ``retries`` more tries after connection errors, 5xx and 429,
        waiting ``backoff_s * 2**k`` before try ``k + 1``; the first retry of the run is
        logged where ``log_retry``."""
        for attempt in range(self.retries + 1):
            try:
                return self._post_once(body, n)
            except _Retryable as e:
                if attempt == self.retries:
                    raise _Failed(f"{e}; gave up after {self.retries} retries "
                                  "(reward.retries)") from e  # fmt: skip
                with self._conns_lock:
                    self.total_retries += 1
                    first, self._logged_retry = not self._logged_retry, True
                if first and log_retry:
                    log.warning("remote reward %s: %s; retrying (further retries are not "
                                "logged)", self.url, e)  # fmt: skip
                time.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    def _score_slice(self, items: list[dict[str, Any]]) -> list[Outcome]:
        body = json.dumps({"items": items}, default=str).encode()
        try:
            return [Outcome("ok", v) for v in self._post(body, len(items))]
        except _Failed as e:
            return [Outcome(e.status, detail=str(e))] * len(items)

    # ------------------------------------------------------------------ a batch
    def map(self, args: Sequence[tuple[str, str, str]],
            rows: Sequence[dict[str, Any]] | None = None) -> list[Outcome]:  # fmt: skip
        """One outcome per ``(prompt, response, answer)``, in order. ``rows[i]``: the data
        row of item ``i``; its keys other than prompt/response/answer ride along."""
        items = []
        for i, (p, r, a) in enumerate(args):
            extra = {k: v for k, v in rows[i].items() if k not in _RESERVED} if rows else {}
            items.append({**extra, "prompt": p, "response": r, "answer": a})
        b = self.batch_size
        slices = [items[i : i + b] for i in range(0, len(items), b)]
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.concurrency, "remote-reward")
        results: list[Outcome] = []
        for part in self._executor.map(self._score_slice, slices):  # in order: by index
            results.extend(part)
        return results

    def probe(self) -> None:
        """POST an empty batch, expecting ``{"rewards": []}``: ValueError (one line, naming
        the URL and the fix) when the server cannot be reached or does not answer so."""
        try:
            self._post(json.dumps({"items": []}).encode(), 0, log_retry=False)
        except _Failed as e:
            raise ValueError(
                f"reward.name={self.url!r}: the reward server did not answer an empty batch "
                f'{{"items": []}} with {{"rewards": []}} ({e}): start the server, or fix '
                "the URL."
            ) from None
        finally:
            self._drop_connection()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        with self._conns_lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()


def reward_server(
    score: Callable[[list[dict[str, Any]]], list[float]], host: str = "127.0.0.1", port: int = 0
) -> ThreadingHTTPServer:
    """The server side of the protocol (the bench's server, the judge): ``POST {"items":
    [...]}`` -> ``{"rewards": score(items)}``; 400 for a body that is not that, 500 with the
    error when ``score`` raises (the client retries a 5xx). Kept-alive connections with
    ``TCP_NODELAY`` (headers and body go out in two writes: without it the second waits for
    the client's delayed ACK, ~40 ms on Linux) and a listen backlog for every client at
    once (``http.server``'s default is 5). ``server_address`` has the port it got."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                items = body["items"]
                if not isinstance(items, list):
                    raise TypeError("items is not a list")
            except (ValueError, KeyError, TypeError) as e:
                return self._answer(400, {"error": f'expected {{"items": [...]}}: {e}'})
            try:
                rewards = score(items)
            except Exception as e:  # noqa: BLE001 - the client retries a 5xx
                return self._answer(500, {"error": f"{type(e).__name__}: {e}"})
            self._answer(200, {"rewards": rewards})

        def _answer(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            log.debug(format, *args)

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 1024

    return Server((host, port), Handler)
