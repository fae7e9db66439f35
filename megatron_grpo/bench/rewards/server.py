"""A reward of the project served over HTTP, the protocol of ``reward.name=http://...``
(docs/rewards-and-data.md, "Remote rewards"): ``POST {"items": [...]}`` ->
``{"rewards": [...]}``, scored by ``build_reward(reward.name=NAME)`` in the server's
process. ``bench rewards`` runs it in a process of its own."""

from __future__ import annotations

from http.server import ThreadingHTTPServer
from multiprocessing.connection import Connection

from megatron_grpo.config.schema import RewardConfig
from megatron_grpo.platform.lifetime import die_with_parent
from megatron_grpo.rewards import RewardFn, build_reward
from megatron_grpo.rewards.remote import reward_server


def make_server(reward_fn: RewardFn, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """The protocol's server (``rewards.remote.reward_server``) scoring each request's items
    with ``reward_fn``; ``server_address`` has the port it got."""

    def score(items: list[dict]) -> list[float]:
        rewards, _ = reward_fn([it["prompt"] for it in items], [it["response"] for it in items],
                               [it["answer"] for it in items])  # fmt: skip
        return rewards

    return reward_server(score, host, port)


def serve(reward_name: str, conn: Connection) -> None:
    """A child process's main: serve ``reward_name`` on the loopback, send the port on
    ``conn``, and serve until killed (with its parent at the latest)."""
    die_with_parent()
    with build_reward(RewardConfig(name=reward_name)) as fn:
        httpd = make_server(fn)
        conn.send(httpd.server_address[1])
        httpd.serve_forever()
