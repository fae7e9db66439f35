"""``bench episodes``: one vLLM engine (a spawned rank, colocated as in training) generates
the same number of model tokens two ways: one turn of ``turns x turn_tokens`` tokens per
sample, and episodes of ``turns`` turns of ``turn_tokens`` tokens (``env.max_turn_tokens``)
with a short environment reply between turns (``FixedReply``), through the agent loop
(``rollout/agent.py``). Model tokens per second of each, their ratio, and where the
multi-turn time goes (turns, environment calls)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_grpo.bench.common import format_table, machine_info, package_versions
from megatron_grpo.distributed.spawn import spawn_ranks


class FixedReply:
    """The bench's environment: answers every turn with the same short text; the episode
    ends when the agent loop's ``env.max_turns`` is reached."""

    def __init__(self, row: dict) -> None:
        pass

    def step(self, text: str) -> tuple[str | None, float | None]:
        return " ok=", 0.0


@dataclass(frozen=True)
class BenchEpisodesArgs:
    prompts: int = 16
    """Prompts per generate."""
    samples: int = 4
    """Samples (episodes) per prompt."""
    turns: int = 4
    """Model turns per episode."""
    turn_tokens: int = 16
    """Model tokens per turn (``env.max_turn_tokens``); the one-turn side samples
    ``turns x turn_tokens``."""
    repeats: int = 3
    """Timed generates per side (median), after one untimed."""
    preset: str = "tiny"
    cache_dir: str = "runs/bench"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for key in ("prompts", "samples", "turns", "turn_tokens", "repeats"):
            if getattr(self, key) < 1:
                raise ValueError(f"--{key.replace('_', '-')} {getattr(self, key)} must be >= 1.")


def run_bench_episodes(a: BenchEpisodesArgs) -> dict[str, Any]:
    model = Path(a.cache_dir) / f"episodes_{a.preset}"
    res = spawn_ranks(_rank, 1, str(model), dataclasses.asdict(a), timeout_s=a.timeout_s)[0]
    return {"args": dataclasses.asdict(a), "machine": machine_info(),
            "versions": package_versions(), **res}  # fmt: skip


def _rank(rank: int, world: int, model_dir: str, args: dict) -> dict[str, Any]:
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from megatron_grpo.config.schema import EnvConfig
    from megatron_grpo.models.tiny import build_hf_model
    from megatron_grpo.rollout import RolloutEngine
    from megatron_grpo.rollout.agent import AgentLoop

    a = BenchEpisodesArgs(**args)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = Path(model_dir)
    if not (model / "config.json").exists():
        build_hf_model(model, preset=a.preset, seed=0)
    tok = AutoTokenizer.from_pretrained(model)
    total = a.turns * a.turn_tokens
    reply = len(tok.encode(" ok=", add_special_tokens=False))
    budget = total + (a.turns - 1) * reply
    eng = RolloutEngine(model, tp=1, max_model_len=64 + budget, cpu_kv_cache_gb=0.5,
                        enforce_eager=True)  # fmt: skip
    prompts = [tok.encode(f"max {i % 10} {(3 * i) % 10}=", add_special_tokens=False)
               for i in range(a.prompts)]  # fmt: skip
    sampling: dict[str, Any] = dict(temperature=1.0, top_p=1.0, top_k=-1, stop_token_ids=None)
    env = EnvConfig(name=f"{__name__}:FixedReply", max_turns=a.turns,
                    max_turn_tokens=a.turn_tokens)  # fmt: skip
    loop = AgentLoop(env, tok, chat=False)
    seeds = [100 * i for i in range(a.prompts)]

    def one_turn() -> list:
        return eng.generate(prompts, n=a.samples, seeds=seeds, max_new_tokens=total, **sampling)

    def episodes() -> list:
        return loop.generate(eng, prompts, [{}] * a.prompts, seeds=seeds, n=a.samples,
                             max_new_tokens=budget, **sampling)  # fmt: skip

    out: dict[str, Any] = {}
    for side, fn in (("one_turn", one_turn), ("multi_turn", episodes)):
        fn()
        times, tokens, turns = [], 0, 0.0
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            samples = fn()
            times.append(time.perf_counter() - t0)
            tokens = sum(s.model_tokens for s in samples)
            turns = sum(s.turns for s in samples) / len(samples)
        s = statistics.median(times)
        out[side] = {"seconds": s, "model_tokens": tokens, "tokens_per_s": tokens / s,
                     "turns_mean": turns, "times": times}  # fmt: skip
    out["ratio_tokens_per_s"] = out["multi_turn"]["tokens_per_s"] / out["one_turn"]["tokens_per_s"]
    out["slowdown"] = 1 / out["ratio_tokens_per_s"]
    eng.shutdown()
    dist.destroy_process_group()
    return out


def episodes_table(res: dict[str, Any]) -> str:
    a = res["args"]
    head = (f"bench episodes: {a['preset']}, {a['prompts']} prompts x {a['samples']} samples, "
            f"{a['turns']} turns x {a['turn_tokens']} tokens vs one turn of "
            f"{a['turns'] * a['turn_tokens']}; median of {a['repeats']}")  # fmt: skip
    rows = [
        (
            side,
            f"{r['seconds']:.3f}",
            f"{r['model_tokens']:,}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['turns_mean']:.2f}",
        )  # fmt: skip
        for side, r in (("one turn", res["one_turn"]), ("multi-turn", res["multi_turn"]))
    ]
    foot = [
        f"multi-turn / one-turn: {res['ratio_tokens_per_s']:.2f}x tokens/s "
        f"({res['slowdown']:.2f}x the time per model token)"
    ]
    return format_table(["side", "s", "model tokens", "tokens/s", "turns"], rows,
                        [-12, 9, 14, 12, 7], head=[head], foot=foot)  # fmt: skip
