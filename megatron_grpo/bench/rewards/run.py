"""``bench rewards``: the reward phase of one step (``items`` responses of GSM8K-like text)
scored in-process by ``reward.name=NAME``, and by the same reward behind a loopback HTTP
server (``bench/rewards/server.py``, its own process) through ``reward.name=http://...``
at ``concurrency`` requests of ``batch_size`` items in flight. Median seconds of each
side, the ratio, and whether the two sides' rewards are identical; no timing is asserted."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from megatron_grpo.bench.common import format_table, machine_info
from megatron_grpo.bench.rewards.server import serve
from megatron_grpo.config.schema import RewardConfig
from megatron_grpo.rewards import RewardFn, build_reward

REWARDS = ("gsm8k", "gsm8k_flexible", "math")


@dataclass(frozen=True)
class BenchRewardsArgs:
    reward: str = "gsm8k"
    """The reward scored on both sides (a built-in)."""
    items: int = 512
    """Responses in the step (prompts x group size)."""
    concurrency: int = 64
    """``reward.concurrency`` of the remote side."""
    batch_size: int = 8
    """``reward.batch_size`` of the remote side."""
    repeats: int = 5
    """Timed reward phases per side (median), after one untimed."""

    def __post_init__(self) -> None:
        if self.reward not in REWARDS:
            raise ValueError(f"--reward {self.reward} is not one of {list(REWARDS)}.")
        for key in ("items", "concurrency", "batch_size", "repeats"):
            if getattr(self, key) < 1:
                raise ValueError(f"--{key.replace('_', '-')} {getattr(self, key)} must be >= 1.")


def gsm8k_like(n: int, seed: int = 0) -> tuple[list[str], list[str], list[str], list[dict]]:
    """``n`` (prompt, response, answer, row) of GSM8K's shape: a ~300-character question,
    a ~600-character worked answer ending in ``#### N`` (right for about half) and the gold
    ``N`` (and a row with a worked solution, which rides along to the server); a MATH-style ``\\boxed{N}`` closes each response too."""
    rng = random.Random(seed)
    prompts, responses, answers, rows = [], [], [], []
    for i in range(n):
        a, b, c = rng.randrange(2, 99), rng.randrange(2, 99), rng.randrange(2, 9)
        gold = (a + b) * c
        said = gold if rng.random() < 0.5 else gold + rng.randrange(1, 9)
        q = (f"Natalia sold clips to {a} of her friends in April, and then she sold {b} more "
             f"clips in May. Each clip costs ${c}. How much money did Natalia make from the "
             "clips she sold in April and May altogether? Show your work, then give the final "
             "answer after ####.")  # fmt: skip
        work = (f"In April Natalia sold {a} clips. In May she sold {b} more clips, so in total "
                f"she sold {a} + {b} = {a + b} clips over the two months. Each clip costs "
                f"${c}, so the money she made is the number of clips times the price of one "
                f"clip: {a + b} * {c} = {said}. Checking: {a + b} clips at ${c} each is "
                f"{said} dollars, which is the total for April and May together. ")  # fmt: skip
        prompts.append(f"Question: {q}\nAnswer:")
        responses.append(f"{work}\n#### {said}\nThe answer is \\boxed{{{said}}}.")
        answers.append(str(gold))  # the gold as DeepScaleR stores it; GSM8K's rule reads it too
        rows.append(
            {
                "question": q,
                "answer": str(gold),
                "id": i,
                "solution": f"{a} + {b} = {a + b}; {a + b} * {c} = {gold}\n#### {gold}",
            }
        )
    return prompts, responses, answers, rows


def _time(
    fn: RewardFn, batch: tuple, repeats: int, rows: list[dict] | None
) -> tuple[list[float], list[float]]:
    p, r, a = batch
    rewards, _ = fn(p, r, a, rows=rows)  # untimed: warm caches, connections, workers
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        rewards, info = fn(p, r, a, rows=rows)
        times.append(time.perf_counter() - t0)
        if info["errors"] or info["timeouts"]:
            raise RuntimeError(f"bench rewards: {info['errors']} errors, {info['timeouts']} "
                               "timeouts in a timed phase: the machine is too loaded.")  # fmt: skip
    return times, rewards


def run_bench_rewards(a: BenchRewardsArgs) -> dict[str, Any]:
    prompts, responses, answers, rows = gsm8k_like(a.items)
    batch = (prompts, responses, answers)
    with build_reward(RewardConfig(name=a.reward)) as fn:
        local_times, local_rewards = _time(fn, batch, a.repeats, None)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    # not a daemon: a daemon process may not start the math reward's worker pool
    proc = ctx.Process(target=serve, args=(a.reward, child))
    proc.start()
    try:
        deadline = time.monotonic() + 120
        while not parent.poll(0.1):
            if not proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"bench rewards: the reward server did not start (exit code "
                                   f"{proc.exitcode}, 120 s at most).")  # fmt: skip
        url = f"http://127.0.0.1:{parent.recv()}/score"
        cfg = RewardConfig(name=url, concurrency=a.concurrency, batch_size=a.batch_size,
                           timeout_s=60.0)  # fmt: skip
        with build_reward(cfg) as fn:
            remote_times, remote_rewards = _time(fn, batch, a.repeats, rows)
    finally:
        proc.kill()  # the server this function started
        proc.join(timeout=30)
    local, remote = statistics.median(local_times), statistics.median(remote_times)
    return {
        "args": dataclasses.asdict(a),
        "machine": machine_info(),
        "in_process": {"seconds": local, "times": local_times},
        "remote": {
            "seconds": remote,
            "times": remote_times,
            "url": url,
            "requests": -(-a.items // a.batch_size),
        },
        "ratio": remote / local,
        "added_s": remote - local,
        "identical": local_rewards == remote_rewards,
        "mean_reward": sum(local_rewards) / len(local_rewards),
    }


def rewards_table(res: dict[str, Any]) -> str:
    a = res["args"]
    head = (f"bench rewards: reward={a['reward']}, {a['items']} GSM8K-like responses; remote: "
            f"{res['remote']['requests']} requests of {a['batch_size']} items, "
            f"{a['concurrency']} in flight, loopback; median of {a['repeats']}")  # fmt: skip
    rows = [
        (side, f"{r['seconds'] * 1e3:.1f}", f"{a['items'] / r['seconds']:,.0f}")
        for side, r in (("in-process", res["in_process"]), ("remote", res["remote"]))
    ]
    foot = [f"remote / in-process: {res['ratio']:.2f}x the reward phase "
            f"({res['added_s'] * 1e3:+.1f} ms per step); rewards identical: "
            f"{'yes' if res['identical'] else 'NO'}"]  # fmt: skip
    return format_table(["side", "ms", "items/s"], rows, [-12, 9, 10], head=[head], foot=foot)
