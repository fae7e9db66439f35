"""A reward of the project served over HTTP, the protocol of ``reward.name=http://...``
(docs/rewards-and-data.md, "Remote rewards"): ``POST {"items": [...]}`` ->
``{"rewards": [...]}``, scored by ``build_reward(reward.name=NAME)`` in the server's
process. ``bench rewards`` runs it in a process of its own."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import Connection

from megatron_grpo.config.schema import RewardConfig
from megatron_grpo.platform.lifetime import die_with_parent
from megatron_grpo.rewards import RewardFn, build_reward


def make_server(reward_fn: RewardFn, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A threading HTTP server (keep-alive) that scores each request's items with
    ``reward_fn``; ``server_address`` has the port it got."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # headers and body go out in two writes: without TCP_NODELAY the second waits for
        # the client's delayed ACK (~40 ms on Linux) on a kept-alive connection
        disable_nagle_algorithm = True

        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["items"]
            rewards, _ = reward_fn([it["prompt"] for it in items],
                                   [it["response"] for it in items],
                                   [it["answer"] for it in items])  # fmt: skip
            data = json.dumps({"rewards": rewards}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 1024  # the listen backlog (5 by default): 64 clients connect at once

    httpd = Server((host, port), Handler)
    return httpd


def serve(reward_name: str, conn: Connection) -> None:
    """A child process's main: serve ``reward_name`` on the loopback, send the port on
    ``conn``, and serve until killed (with its parent at the latest)."""
    die_with_parent()
    with build_reward(RewardConfig(name=reward_name)) as fn:
        httpd = make_server(fn)
        conn.send(httpd.server_address[1])
        httpd.serve_forever()
