"""``megatron-grpo eval``: generate from a model through the trainer's own path and score it.

Design: docs/eval.md, "How eval runs (evaluation/evaluate.py)".
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from megatron_grpo.config import Config, ConfigError, load_config, parse_overrides
from megatron_grpo.data import build_prompt_source
from megatron_grpo.distributed import destroy_distributed, init_distributed, spawn
from megatron_grpo.environments.contract import load_environment
from megatron_grpo.evaluation.source import ModelSource, load_megatron_weights, resolve_model
from megatron_grpo.layouts.io import load_hf_into_megatron
from megatron_grpo.metrics.pass_at_k import mean_pass_at_k
from megatron_grpo.models.spec import check_heads, load_spec
from megatron_grpo.policy.policy import build_policy
from megatron_grpo.rewards import build_reward
from megatron_grpo.rewards.judge import client_config, is_judge
from megatron_grpo.rewards.scoring import env_scored
from megatron_grpo.rollout.colocated import build_colocated
from megatron_grpo.rollout.interface import sampling_args
from megatron_grpo.rollout.judge import start_judge
from megatron_grpo.rollout.samples import Sample
from megatron_grpo.trainer.collate import collate


@dataclass
class EvalSettings:
    """Everything a rank needs; built once by :func:`prepare`, pickled to spawned ranks."""

    cfg: Config
    source: ModelSource
    prompt_ids: list[list[int]]
    samples: int
    """K samples per prompt (1 with ``greedy``)."""
    greedy: bool
    eos_token_id: int | None
    threads: int = 0
    """torch threads per spawned rank (0: leave torch's default)."""
    policy_logprobs: bool = False
    """Also score every response with the Megatron policy (the dump's ``policy_logprobs``)."""
    rows: list[dict[str, Any]] | None = None
    """Each prompt's data row, for multi-turn episodes (``env.name``); None otherwise."""


@dataclass
class EvalResult:
    pass_at: dict[int, float]
    mean_reward: float
    num_prompts: int
    samples: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    sync: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- plan
def eval_world(train_tp: int, train_pp: int, rollout_tp: int) -> int:
    """Ranks to spawn: the smallest world both layouts fit (Megatron DP fills it)."""
    return math.lcm(train_tp * train_pp, rollout_tp)


def _reward_name(data: str, config: str | None, overrides: list[str]) -> str | None:
    """reward.name when set in --config or the overrides, else None."""
    import yaml

    name = None
    if config and Path(config).is_file():
        raw = yaml.safe_load(Path(config).read_text()) or {}
        name = (raw.get("reward") or {}).get("name") if isinstance(raw, dict) else None
    tree = parse_overrides([o for o in overrides if o.split("=", 1)[0].strip() == "reward.name"])
    return (tree.get("reward") or {}).get("name", name)


def prepare(
    *,
    model: str,
    data: str,
    train_tp: int = 1,
    train_pp: int = 1,
    rollout_tp: int = 1,
    max_new_tokens: int = 16,
    samples: int = 1,
    greedy: bool = True,
    limit: int = 0,
    hf_config: str | None = None,
    config: str | None = None,
    overrides: list[str] | None = None,
    policy_logprobs: bool = False,
) -> EvalSettings:
    """Validate the command and load the prompts (no process groups, no vLLM)."""
    from transformers import AutoTokenizer

    overrides = list(overrides or [])
    _check_flags(
        data, config, overrides, greedy=greedy, samples=samples, sizes={
            "--train-tp": train_tp, "--train-pp": train_pp, "--rollout-tp": rollout_tp,
            "--max-new-tokens": max_new_tokens, "--samples": samples,
        },
    )  # fmt: skip
    source = resolve_model(model, hf_config)
    try:  # before any rank starts: a spawned rank's traceback is not an answer
        check_heads(load_spec(source.hf_dir), train_tp, rollout_tp)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    forced = [
        f"data.source={data}", f"parallel.tp={train_tp}", f"parallel.pp={train_pp}",
        "parallel.vpp=null", f"rollout.tp={rollout_tp}", "rollout.placement=colocated",
        f"rollout.max_new_tokens={max_new_tokens}", f"model.hf_path={source.hf_dir}",
    ]  # fmt: skip
    cfg = load_config(config, overrides + forced)
    if cfg.model.dtype == "auto":
        cfg = replace(cfg, model=replace(cfg.model, dtype="float32"))
    world = int(os.environ.get("WORLD_SIZE", "0")) or eval_world(train_tp, train_pp, rollout_tp)
    if world % (train_tp * train_pp) or world % rollout_tp:
        raise ConfigError(
            f"WORLD_SIZE={world} is not a multiple of tp*pp={train_tp * train_pp} and of "
            f"rollout tp={rollout_tp}: launch {eval_world(train_tp, train_pp, rollout_tp)} "
            "ranks (or a multiple), or run without torchrun to let eval spawn them."
        )
    tok = AutoTokenizer.from_pretrained(source.hf_dir)
    ordered = _prompts_in_file_order(cfg, tok, limit)
    if cfg.env.multi_turn:
        try:
            load_environment(cfg.env.name)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return EvalSettings(
        cfg=cfg, source=source, prompt_ids=[list(p.prompt_ids) for p in ordered],
        samples=samples, greedy=greedy, eos_token_id=tok.eos_token_id,
        policy_logprobs=policy_logprobs,
        rows=[p.row for p in ordered] if cfg.env.multi_turn else None,
    )  # fmt: skip


def _check_flags(data: str, config: str | None, overrides: list[str], *, greedy: bool,
                 samples: int, sizes: dict[str, int]) -> None:  # fmt: skip
    """The command's flags, each bad value one ConfigError line naming it and the fix."""
    for flag, v in sizes.items():
        if v < 1:
            raise ConfigError(f"{flag}={v} must be >= 1.")
    if greedy and samples != 1:
        raise ConfigError(f"--greedy draws one sample per prompt, not --samples {samples}.")
    if not data.startswith("synthetic:") and not Path(data).exists():
        raise ConfigError(
            f"--data {data}: no such file; pass a .jsonl/.parquet file or synthetic:<task>."
        )
    if _reward_name(data, config, overrides) is None and not data.startswith("synthetic:"):
        raise ConfigError(
            f"--data {data} is not synthetic, so the reward cannot be guessed: add "
            "reward.name=gsm8k (or gsm8k_flexible, math, synthetic, package.module:function, "
            "http://HOST:PORT/PATH)."
        )


def _prompts_in_file_order(cfg, tok, limit: int) -> list[Any]:
    """Every prompt once, in the file's order (the source shuffles; rows identify them),
    the first ``limit`` when set."""
    try:
        prompts = build_prompt_source(cfg.data, tok)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    ordered = sorted(prompts.next_batch(len(prompts)), key=lambda p: p.meta["row"])
    if limit:
        ordered = ordered[:limit]
    return ordered


# ----------------------------------------------------------------------------- ranks
def eval_rank(rank: int, world: int, s: EvalSettings) -> dict[str, Any] | None:
    """One rank: Megatron policy <- weights, bridge -> vLLM, generate. Collective.

    Returns (on rank 0) the samples, prompt-major, and the sync report; None elsewhere."""
    from functools import partial

    import torch

    if s.threads:
        torch.set_num_threads(s.threads)
    cfg, src = s.cfg, s.source
    spec = load_spec(src.hf_dir)
    ctx = init_distributed(cfg.parallel, spec, seed=cfg.seed)
    rollout = None
    try:
        init = None
        if src.kind == "hf":
            init = partial(load_hf_into_megatron, hf_dir=src.hf_dir, spec=spec, ctx=ctx)
        # Greedy: vLLM's processed log-probs are the T=1 log_softmax (vllm Sampler.sample).
        temperature = 1.0 if s.greedy else cfg.rollout.temperature
        policy = build_policy(
            spec, ctx, cfg.model, None, init_weights=init, temperature=temperature
        )
        engine_kwargs: dict[str, Any] = {}
        if src.kind != "hf":
            load_megatron_weights(policy, src)
            engine_kwargs["load_format"] = "dummy"  # every weight arrives through the bridge
        rollout, weight_sync = build_colocated(src.hf_dir, spec, ctx, cfg, policy, **engine_kwargs)
        report = weight_sync.push(policy)
        r = cfg.rollout
        samples = rollout.generate(
            s.prompt_ids,
            seed=r.seed,
            rows=s.rows,
            **sampling_args(r, s.samples, s.eos_token_id, 0.0 if s.greedy else None),
        )
        layout = {"tp": ctx.tp, "pp": ctx.pp, "dp": ctx.dp, "world": ctx.world_size}
        policy_lp = _policy_logprobs(policy, samples, cfg.grpo.batch.micro_batch_size) if (
            s.policy_logprobs) else None  # fmt: skip
    finally:
        if rollout is not None:
            rollout.shutdown()
        destroy_distributed()
    if rank != 0:
        return None
    return {"samples": samples, "sync": report.to_dict(), "layout": layout,
            "policy_logprobs": policy_lp}  # fmt: skip


def _policy_logprobs(policy, samples, micro_batch_size: int) -> list[list[float]]:
    """The policy's log-probs of each sample's response tokens (collective; every rank holds
    all samples, so every DP replica scores the whole list)."""
    logp = policy.compute_logprobs(collate(samples, 0), micro_batch_size)["logp"]
    out = []
    for i, x in enumerate(samples):
        p, r = len(x.prompt_ids), len(x.response_ids)
        out.append(logp[i, p : p + r].tolist())
    return out


def generate(s: EvalSettings, timeout_s: float = 1800.0) -> dict[str, Any] | None:
    """Run :func:`eval_rank` on the right processes; rank 0's result (None on other ranks)."""
    if "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        return eval_rank(int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"]), s)
    p, r = s.cfg.parallel, s.cfg.rollout
    world = eval_world(p.tp, p.pp, r.tp)
    if world == 1:
        return eval_rank(0, 1, s)

    threads = max(1, (os.cpu_count() or 1) // world)
    # through the module: tests/bad_inputs.py stubs spawn_ranks out there
    return spawn.spawn_ranks(
        eval_rank, world, replace(s, threads=threads), timeout_s=timeout_s, result_types=(Sample,)
    )[0]


# ----------------------------------------------------------------------------- scoring
def score(s: EvalSettings, out: dict[str, Any]) -> EvalResult:
    """Rewards, pass@{1,K} and the dump rows of rank 0's samples."""
    from transformers import AutoTokenizer

    cfg = s.cfg
    tok = AutoTokenizer.from_pretrained(s.source.hf_dir)
    src = build_prompt_source(cfg.data, tok)
    by_ids = {tuple(p.prompt_ids): p for p in src.next_batch(len(src))}
    samples, k = out["samples"], s.samples
    policy_lp = out.get("policy_logprobs")
    prompts = [by_ids[tuple(ids)] for ids in s.prompt_ids]
    texts = tok.batch_decode([x.response_ids for x in samples], skip_special_tokens=True)
    args = ([prompts[i // k].text for i in range(len(samples))], texts,
            [prompts[i // k].answer for i in range(len(samples))])  # fmt: skip
    rows = [prompts[i // k].row for i in range(len(samples))]  # a remote reward's extras
    with _judge_served(cfg) as reward_cfg, build_reward(reward_cfg, cfg.data) as reward_fn:
        rewards, info = reward_fn(*args, rows=rows)
    task = info["task_scores"]
    if s.rows is not None:  # an episode's environment scores it where it gave a reward
        rewards, task = env_scored(samples, rewards), env_scored(samples, task)
    correct = [t >= 1.0 for t in task]  # the format bonus does not count
    correct_PK = [correct[i * k : (i + 1) * k] for i in range(len(prompts))]
    rows = [
        {"prompt_index": i // k, "sample_index": i % k, "prompt": args[0][i],
         "answer": args[2][i], "response": texts[i], "prompt_token_ids": x.prompt_ids,
         "response_token_ids": x.response_ids, "logprobs": x.logprobs,
         **({"policy_logprobs": _model_only(policy_lp[i], x)} if policy_lp is not None else {}),
         "reward": rewards[i], "correct": correct[i], "finish_reason": x.finish_reason,
         **_episode_fields(x)}
        for i, x in enumerate(samples)
    ]  # fmt: skip
    return EvalResult(
        pass_at={kk: mean_pass_at_k(correct_PK, kk) for kk in sorted({1, k})},
        mean_reward=sum(rewards) / len(rewards), num_prompts=len(prompts), samples=k,
        rows=rows, sync=out["sync"],
    )  # fmt: skip


@contextlib.contextmanager
def _judge_served(cfg: Any) -> Iterator[Any]:
    """``cfg.reward``; with ``reward.name=judge:DIR``, the judge started here (the engines
    that generated are down by now) and the remote reward at its URL in its place."""
    if not is_judge(cfg.reward.name):
        yield cfg.reward
        return
    with tempfile.TemporaryDirectory(prefix="megatron-grpo-judge-") as tmp:
        judge = start_judge(cfg, Path(tmp))
        try:
            yield client_config(cfg.reward, judge.url)
        finally:
            judge.close()


def _episode_fields(x: Any) -> dict[str, Any]:
    """A multi-turn episode's dump fields: ``response_mask`` (1 model / 0 environment, per
    response token), ``turns``, how it ended, and its ``logprobs`` null on the environment's
    tokens; {} for one-turn samples."""
    if x.response_mask is None:
        return {}
    return {"response_mask": x.response_mask, "turns": x.turns, "env_end": x.env_end,
            "logprobs": _model_only(x.logprobs, x)}  # fmt: skip


def _model_only(logprobs: list[float], x: Any) -> list[float | None]:
    """``logprobs`` with None on a multi-turn episode's environment tokens."""
    if x.response_mask is None:
        return list(logprobs)
    return [lp if m else None for lp, m in zip(logprobs, x.response_mask)]


def write_dump(path: str | Path, rows: list[dict[str, Any]]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def format_report(s: EvalSettings, res: EvalResult, layout: dict[str, Any]) -> str:
    cfg, r = s.cfg, s.cfg.rollout
    mode = "greedy" if s.greedy else f"{s.samples} samples/prompt at T={r.temperature}"
    sync = res.sync
    lines = [
        f"model   {s.source.describe()}",
        f"data    {cfg.data.source}: {res.num_prompts} prompts, {mode}, "
        f"max_new_tokens={r.max_new_tokens}, reward={cfg.reward.name}",
        f"layout  Megatron tp={layout['tp']} pp={layout['pp']} dp={layout['dp']} -> "
        f"{layout['world'] // r.tp} vLLM engine(s) of tp={r.tp} (world {layout['world']}); "
        f"bridge {sync.get('bytes', 0) / 2**20:.2f} MiB in {sync.get('seconds', 0.0):.2f}s",
    ]
    lines += [f"{f'pass@{kk}':<12}{v:.4f}" for kk, v in res.pass_at.items()]
    lines.append(f"{'mean reward':<12}{res.mean_reward:.4f}")
    return "\n".join(lines)
