"""``megatron-grpo bench ops --loop``: what one trainer step of the real loop asks of the host,
counted by site, outside the policy too (docs/benchmarks.md section 7, "The loop step").

The run is ``trainer.build.build_trainer`` on the tiny preset (no warm start), in-process on
the CPU, with a canned engine where vLLM would be (``CannedEngine``: seeded random responses
of full length, random sampled log-probs; it is also the weight sync's sink, which keeps
nothing). Everything else is the run's own: the window buffer and its rewards, ``collate``,
the advantages, pi_ref's pass (``grpo.kl.kl_coef``), pi_k's and alpha's passes
(``grpo.off_policy.score_alpha``), the drift and staleness measures, the train step, the
sync through the real direct sender (pack, transport, unpack into the sink), the metrics
row and its sinks. Step 1 runs uncounted (the optimizer's state, the first sync's plan);
step 2, with lag 1 and a sync, is counted:

- host-sync-prone calls (``count.SyncCounter``) by ``file:function`` site, each marked as
  inside the policy (``policy/``, megatron-core) or not. The window's arrivals thread, which
  scores rewards, is not seen (torch's function modes are per thread); nor are the engine's
  samples, which a real engine returns as host lists;
- the wall time outside the policy by ``file:function`` site (``Sampler``: each ms, the
  innermost frame of the project or megatron-core on the main thread's stack), so a site's
  seconds hold the torch and library calls it makes; the policy's, the torch modes'
  handlers' (the counter's, the CPU platform layer's) and the rest in their own lines.
  Timings are estimates on a shared CPU; the counts are exact.

``--loop-micro-batches 2,4`` runs the step at each number of packed micro-batches (the
budget ``grpo.batch.micro_batch_tokens`` that cuts the batch's shard into that many), so the
table shows which sites grow with them.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

from megatron_grpo.bench.common import format_table, package_versions
from megatron_grpo.bench.ops.count import SyncCounter, short_path
from megatron_grpo.bridge.transfer_group import PlanInputs
from megatron_grpo.bridge.weight_sync import colocated_sender
from megatron_grpo.distributed.placement import colocated_engines
from megatron_grpo.rollout.colocated import ColocatedRollout
from megatron_grpo.rollout.samples import Sample

POLICY_SITES = ("megatron_grpo/policy/", "megatron/")
"""Sites inside the policy: the project's policy package and megatron-core."""


@dataclass
class LoopArgs:
    loop_micro_batches: str = "2,4"
    """Packed micro-batches of the counted step's passes, a comma list: one run each."""
    prompts: int = 4
    group_size: int = 4
    row_tokens: int = 48
    """Prompt + response tokens of every row (the canned engine's responses fill each
    prompt, at most half of it, up to it), so any order of the rows packs into the same
    micro-batches."""
    seed: int = 0
    top: int = 12
    """Rows of the Python-time table."""
    warmup: bool = True
    """Run the first setting once uncounted first, so that the process's one-time costs
    (imports, first calls) are in no run's seconds (the counts are the same without it)."""

    @property
    def micro_batches(self) -> list[int]:
        return [int(k) for k in self.loop_micro_batches.split(",")]

    def __post_init__(self) -> None:
        rows = self.prompts * self.group_size
        try:
            ks = self.micro_batches
        except ValueError:
            ks = [0]
        if not ks or any(k < 1 or rows % k or rows // k < 2 for k in ks) or len(set(ks)) != len(ks):
            raise ValueError(
                f"--loop-micro-batches={self.loop_micro_batches!r}: a comma list of distinct "
                f"numbers that divide the step's {rows} rows (prompts x group size) into "
                "micro-batches of at least 2 rows, e.g. 2,4."
            )


class CannedEngine:
    """The engine seam without a model: ``generate`` gives each request seeded random tokens
    for ``max_new_tokens`` (no stop) with random log-probs, and the weight sync's sink
    receives each shard and keeps none."""

    tp, replica_index = 1, 0

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.vocab_size, self.seed = vocab_size, seed
        self.shards = 0

    def generate(self, prompt_token_ids, n=1, max_new_tokens=16, seeds=None, **_) -> list[Sample]:
        """Plain Python (no torch call), as a real engine hands back host lists."""
        out = []
        for i, prompt in enumerate(prompt_token_ids):
            size = max_new_tokens - len(prompt)  # every row max_new_tokens long
            if size < 1:
                raise ValueError(
                    f"bench ops --loop: a prompt of {len(prompt)} tokens leaves no response in "
                    f"rows of {max_new_tokens}; raise the row length."
                )
            for j in range(n):
                g = random.Random((seeds[i] if seeds else i) + j)
                ids = [g.randrange(3, self.vocab_size) for _ in range(size)]
                logps = [-3 * g.random() for _ in range(size)]
                out.append(Sample(list(prompt), ids, logps, "length", "0"))
        return out

    def begin_weight_update(self, record_checksums: bool = False) -> CannedEngine:
        return self

    def receive_shard(self, name: str, tensor: torch.Tensor) -> None:
        self.shards += 1

    def finish_weight_update(self) -> float:
        return 0.0

    def update_phases(self, stats: Any) -> None:
        pass

    def sleep(self, level: int = 1) -> None:
        pass

    def wake_up(self, tags: list[str] | None = None) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _canned_factory(seed: int):
    """``build_trainer``'s ``rollout_factory``: the canned engine behind the colocated
    rollout and the real direct sender."""

    def factory(cfg, world, ctx, hf_dir, policy):
        engine = CannedEngine(policy.spec.vocab_size, seed)
        inputs = PlanInputs.of(hf_dir, ctx, policy, cfg.sync, 1, colocated_engines(1, 1))
        sender = colocated_sender(inputs, policy.spec, ctx, engine, cfg.sync)
        return ColocatedRollout(engine, ctx, 1), sender

    return factory


def _overrides(args: LoopArgs, run_dir: str, micro_batches: int) -> list[str]:
    rows = args.prompts * args.group_size
    tokens = args.row_tokens * (rows // micro_batches)  # every row is row_tokens long
    return [
        f"run_dir={run_dir}", "steps=2", "sync.interval=2", f"seed={args.seed}",
        "model.hf_path=tiny", "model.warm_start_steps=0", "model.dtype=float32",
        f"grpo.group_size={args.group_size}", f"grpo.batch.prompts_per_step={args.prompts}",
        f"grpo.batch.micro_batch_tokens={tokens}", f"rollout.max_new_tokens={args.row_tokens}",
        f"data.max_prompt_tokens={args.row_tokens // 2}",  # a budget of 2 rows holds any row
        "grpo.kl.kl_coef=0.01", "grpo.off_policy.score_alpha=true",
        "logging.progress=false", "logging.tensorboard=false", "logging.plots=false",
        "checkpoint.interval=0", "checkpoint.save_at_end=false", "reward.num_workers=1",
    ]  # fmt: skip


class _Step2:
    """Counts from the loop's second step on (``PhaseTimer.reset``, which ``run`` calls as
    each step begins) to ``finish`` (the run's summary, not counted)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer, self.steps = trainer, 0
        self.syncs, self.sampler = SyncCounter(), Sampler()
        self.seconds = 0.0
        reset, finish = trainer.timer.reset, trainer.finish

        def on_reset() -> None:
            self.steps += 1
            if self.steps == 2:
                self.syncs.__enter__()
                self.t0 = time.perf_counter()
                self.sampler.__enter__()
            reset()

        def on_finish() -> Any:
            if self.steps == 2:
                self.sampler.__exit__(None, None, None)
                self.seconds = time.perf_counter() - self.t0
                self.syncs.__exit__(None, None, None)
            return finish()

        trainer.timer.reset, trainer.finish = on_reset, on_finish


def measure_loop(args: LoopArgs, micro_batches: int, run_dir: str) -> dict:
    """Step 2 of a tiny run whose passes cut the batch into ``micro_batches`` packs,
    counted (step 1, uncounted, builds the optimizer's state)."""
    from megatron_grpo.config import load_config
    from megatron_grpo.trainer.build import build_trainer

    cfg = load_config(None, _overrides(args, f"{run_dir}/mb{micro_batches}", micro_batches))
    quiet = io.StringIO()
    # the run's pre-emption handlers (trainer.checkpointer.Preemption) are the run's only
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            trainer = build_trainer(cfg, rollout_factory=_canned_factory(args.seed))
            try:
                step = _Step2(trainer)
                trainer.run()
            finally:
                trainer.close()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if step.steps != 2:
        raise RuntimeError(f"bench ops --loop: the run took {step.steps} steps, not 2")
    return {
        "micro_batches": micro_batches,
        "token_budget": trainer.budget.tokens,
        "rows": args.prompts * args.group_size,
        "row_tokens": args.row_tokens,
        "step_s": step.seconds,
        "host_syncs": _sync_sites(step.syncs),
        "python_s": _python_sites(step.sampler),
    }


def _sync_sites(syncs: SyncCounter) -> dict:
    """The host-sync-prone calls by ``file:function`` (the line dropped), and the totals
    inside and outside the policy."""
    by_site: Counter = Counter()
    for key, n in syncs.counts.by_site.items():
        name, _, where = key.partition(" @ ")
        path, _, rest = where.partition(":")
        func = rest.split(" ", 1)[1] if " " in rest else rest
        by_site[f"{path}:{func} ({name})"] += n
    outside = sum(n for k, n in by_site.items() if not k.startswith(POLICY_SITES))
    return {
        "total": syncs.counts.total,
        "outside_policy": outside,
        "by_site": dict(by_site.most_common()),
    }


_MODES = ("__torch_function__", "__torch_dispatch__")
"""The counter's own mode and the CPU platform layer's (``platform/cpu.py``): not sites."""

_COUNT_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "count.py")
_OWN_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
"""The folder that holds ``megatron_grpo/``."""


class Sampler:
    """Where the thread that enters it spends its wall time, by site: a thread looks at that
    thread's stack every ``interval_s`` and charges the time since its last look to the
    innermost frame of the project or megatron-core (``file:function``; ``<other>`` with no
    such frame) below which no torch mode's handler is (the counter's, the CPU platform
    layer's: their time is their caller's, and also added up in ``<modes>``). Sampled, so
    each site's seconds are an estimate, but the sites add up to the wall time."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self._stop = threading.Event()

    def _site(self, frame: FrameType | None) -> tuple[str, bool]:
        """The sampled frame's site, and whether a torch mode's handler ran below it."""
        in_mode = False
        while frame is not None:
            path = frame.f_code.co_filename
            if frame.f_code.co_name in _MODES or path == _COUNT_FILE:
                in_mode = True
            elif path.startswith(_OWN_ROOT) or "site-packages/megatron/" in path:
                return f"{short_path(path)}:{frame.f_code.co_name}", in_mode
            frame = frame.f_back
        return "<other>", in_mode

    def _run(self, ident: int) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(ident)
            now = time.perf_counter()
            site, in_mode = self._site(frame)
            self.seconds[site] += now - last
            if in_mode:
                self.seconds["<modes>"] += now - last
            last = now

    def __enter__(self) -> Sampler:
        self._thread = threading.Thread(
            target=self._run, args=(threading.get_ident(),), daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _python_sites(sampler: Sampler) -> dict:
    """The sampled seconds by site outside the policy, and those of the policy (policy/ and
    megatron-core), of the rest (torch's and Python's own frames only), and of them all the
    share inside the torch modes' handlers (the counter's; the CPU platform layer's, which a
    GPU run has not)."""
    by_site: dict[str, float] = {}
    policy = 0.0
    for site, seconds in sorted(sampler.seconds.items(), key=lambda kv: -kv[1]):
        if site.startswith(POLICY_SITES):
            policy += seconds
        elif not site.startswith("<"):
            by_site[site] = seconds
    return {
        "outside_policy": sum(by_site.values()),
        "policy": policy,
        "modes": sampler.seconds.get("<modes>", 0.0),
        "other": sampler.seconds.get("<other>", 0.0),
        "by_site": by_site,
    }


def run_bench_loop(args: LoopArgs) -> dict:
    """``measure_loop`` at each number of micro-batches (after an uncounted warm-up run)."""
    ks = args.micro_batches
    with tempfile.TemporaryDirectory(prefix="bench-loop-") as d:
        if args.warmup:
            measure_loop(args, ks[0], f"{d}/warmup")
        runs = [measure_loop(args, k, d) for k in ks]
    return {
        "bench": "ops --loop",
        "versions": package_versions("megatron-core"),
        "config": {
            "preset": "tiny",
            "dtype": "float32",
            "rows": args.prompts * args.group_size,
            "row_tokens": args.row_tokens,
            "kl_coef": 0.01,
            "score_alpha": True,
            "sync_interval": 2,
            "counted_step": 2,
        },  # fmt: skip
        "top": args.top,
        "runs": runs,
        "grows": _grows(runs),
    }


def _grows(runs: list[dict]) -> dict[str, list[int]]:
    """The host-sync sites whose counts differ between the runs: the site and its count in
    each run (micro-batches ascending)."""
    sites = {k for r in runs for k in r["host_syncs"]["by_site"]}
    counts = {k: [r["host_syncs"]["by_site"].get(k, 0) for r in runs] for k in sorted(sites)}
    return {k: v for k, v in counts.items() if len(set(v)) > 1}


def loop_table(res: dict) -> str:
    """The console table of ``run_bench_loop``'s result: host-sync-prone calls by site, one
    column per number of micro-batches, then the Python seconds by site."""
    runs = res["runs"]
    c = res["config"]
    ks = [f"{r['micro_batches']} mb" for r in runs]
    head = [
        f"bench ops --loop: trainer step {c['counted_step']} of a tiny run ({c['rows']} rows of "
        f"{c['row_tokens']} tokens, pi_ref + pi_k + alpha passes, a sync), on cpu, "
        f"megatron-core {res['versions']['megatron-core']}, torch {res['versions']['torch']}",
        "",
        "host-sync-prone calls by site ('policy': policy/ and megatron-core; '*': grows with "
        "the micro-batches)",
    ]
    sites = sorted({k for r in runs for k in r["host_syncs"]["by_site"]},
                   key=lambda k: (k.startswith(POLICY_SITES), -runs[-1]["host_syncs"]["by_site"].get(k, 0), k))  # fmt: skip
    widths = (-78, *[7] * len(runs))
    rows: list = []
    for site in sites:
        mark = "*" if site in res["grows"] else " "
        where = "policy " if site.startswith(POLICY_SITES) else "       "
        rows.append(
            (f"{mark}{where}{site}", *[r["host_syncs"]["by_site"].get(site, 0) for r in runs])
        )
    rows.append((" outside the policy", *[r["host_syncs"]["outside_policy"] for r in runs]))
    rows.append((" total", *[r["host_syncs"]["total"] for r in runs]))
    foot = ["", "wall seconds by site outside the policy (sampled each ms: the innermost "
            "frame of the project or megatron-core)"]  # fmt: skip
    py_sites = list(runs[-1]["python_s"]["by_site"])[: res["top"]]
    py_rows: list = [(f"  {s}", *[f"{r['python_s']['by_site'].get(s, 0.0):.4f}" for r in runs])
                     for s in py_sites]  # fmt: skip
    for key, label in (("outside_policy", "all outside the policy"), ("policy", "the policy"),
                       ("modes", "of all: in torch modes (counter, CPU layer)"),
                       ("other", "no project frame")):  # fmt: skip
        py_rows.append((f"  {label}", *[f"{r['python_s'][key]:.4f}" for r in runs]))
    py_rows.append(("  the step (wall)", *[f"{r['step_s']:.4f}" for r in runs]))
    foot.append(format_table(("site", *ks), py_rows, widths, " "))
    return format_table(("site", *ks), rows, widths, " ", head=head, foot=foot)
