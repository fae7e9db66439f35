"""``megatron-grpo bench ops``: what one train step and one log-prob pass of the project's
policy ask of the device, counted (docs/benchmarks.md, "bench ops").

For a preset (``tiny`` by default; any preset on a GPU) and a seeded GRPO batch cut into
``packs`` packed micro-batches, in bf16 (fp32 main weights, as on a GPU): the ATen ops
dispatched (``bench.ops.count.OpCounter``) in total, per layer per micro-batch (the ops of a
2-layer model of the preset's shape less those of a 1-layer one, over the micro-batches),
the top ops and source sites; the host-sync-prone calls by site (``SyncCounter``); and on
CUDA the kernel launches and stream/device synchronizations of ``torch.profiler``. Each
phase is counted on its second call (the first builds the optimizer's state).

tests/bench/test_op_budget.py holds the tiny figures to ``tests/op_budget.json``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from megatron_grpo.algorithms.step_batch import AdvantagedBatch
from megatron_grpo.bench.common import format_table, package_versions
from megatron_grpo.bench.ops.count import OpCounter, SyncCounter
from megatron_grpo.bench.train.args import bench_spec, resolve_device
from megatron_grpo.bench.train.batch import add_loss_inputs, grpo_loss_fn, make_batch
from megatron_grpo.config.schema import ModelConfig, OptimConfig, ParallelConfig
from megatron_grpo.distributed import destroy_distributed, init_distributed
from megatron_grpo.models.shapes import preset_spec
from megatron_grpo.models.spec import ModelSpec
from megatron_grpo.policy.micro_batches import packed_micro_batches
from megatron_grpo.policy.policy import build_policy


@dataclass
class BenchOpsArgs:
    preset: str = "tiny"
    """A preset of ``models/tiny.py``; the GPU presets want a GPU."""
    rows: int = 8
    """Sequences in the batch."""
    packs: int = 2
    """Packed micro-batches the batch is cut into (the token budget is the smallest that
    gives at most this many)."""
    prompt_len: int = 32
    min_len: int = 8
    max_len: int = 48
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    fused_adam: Literal["auto", "on", "off"] = "on"
    """``optim.fused_adam`` of the policy counted: ``on`` is what ``auto`` gives on a GPU
    (torch's fused AdamW), on a CPU too, like the bf16 default."""
    device: str = "auto"
    seed: int = 0
    top: int = 12
    """Rows of the top-ops and top-sites tables."""

    def __post_init__(self) -> None:
        for k in ("rows", "packs", "prompt_len", "min_len", "max_len", "top"):
            if getattr(self, k) < 1:
                raise ValueError(f"--{k.replace('_', '-')}={getattr(self, k)} must be >= 1.")
        if self.packs > self.rows:
            raise ValueError(
                f"--packs={self.packs} > --rows={self.rows}: a pack holds at least one row; "
                "lower --packs or raise --rows."
            )
        if self.min_len > self.max_len:
            raise ValueError(f"--min-len={self.min_len} > --max-len={self.max_len}.")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"--dtype={self.dtype!r}: choose bfloat16 or float32.")
        if self.fused_adam not in ("auto", "on", "off"):
            raise ValueError(f"--fused-adam={self.fused_adam!r}: choose auto, on or off.")
        preset_spec(self.preset)  # ConfigError naming the presets
        resolve_device(self.device)


def budget_for_packs(lengths: list[int], packs: int) -> int:
    """The smallest token budget that packs rows of ``lengths``, in order, into at most
    ``packs`` micro-batches (``policy.micro_batches.packed_micro_batches``'s greedy rule)."""

    def count(budget: int) -> int:
        n, tokens = 1, 0
        for i, length in enumerate(lengths):
            if i and tokens + length > budget:
                n, tokens = n + 1, 0
            tokens += length
        return n

    lo, hi = max(lengths), sum(lengths)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if count(mid) <= packs else (mid + 1, hi)
    return lo


def _profile_cuda(fn: Callable[[], Any]) -> dict:
    """Kernel launches and host synchronizations of one call of ``fn`` (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    launches = syncs = 0
    for e in prof.events():
        if e.name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel"):
            launches += 1
        elif e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"):
            syncs += 1
        elif e.name.startswith("cudaMemcpy") and "Async" not in e.name:
            syncs += 1
    return {"kernel_launches": launches, "host_syncs": syncs}


def count_call(fn: Callable[[], Any], top: int, device: torch.device) -> dict:
    """The ops and host-sync-prone calls of one call of ``fn`` (and on CUDA the profiler's
    launches and syncs of another call)."""
    ops, syncs = OpCounter(), SyncCounter()
    with syncs, ops:
        fn()
    out = {"ops": ops.counts.to_dict(top), "syncs": syncs.counts.to_dict(top)}
    if device.type == "cuda":
        out["cuda"] = _profile_cuda(fn)
    return out


class _Run:
    """A policy of ``spec`` and the batch's two calls (log-prob pass, train step)."""

    def __init__(
        self, spec: ModelSpec, ctx, args: BenchOpsArgs, batch: AdvantagedBatch, budget: int
    ):
        model_cfg = ModelConfig(dtype=args.dtype)
        optim_cfg = OptimConfig(lr=1e-6, fused_adam=args.fused_adam)
        self.policy = build_policy(spec, ctx, model_cfg, optim_cfg, temperature=1.0)
        self.budget = budget
        self.loss_fn = grpo_loss_fn()
        logp = self.policy.compute_logprobs(batch, 1, token_budget=budget)["logp"]
        self.batch = add_loss_inputs(batch, logp, args.seed)

    def logprobs(self):
        return self.policy.compute_logprobs(self.batch, 1, token_budget=self.budget)

    def train_step(self):
        return self.policy.train_step(self.batch, self.loss_fn, 1, token_budget=self.budget)

    def count(self, top: int, device: torch.device) -> dict[str, dict]:
        out = {}
        for phase, fn in (("logprob", self.logprobs), ("train", self.train_step)):
            fn()  # the first call builds lazy state (the optimizer's moments)
            out[phase] = count_call(fn, top, device)
        return out


def run_bench_ops(args: BenchOpsArgs, ctx=None) -> dict:
    """Counts of the preset's policy and of its 1- and 2-layer variants (per-layer ops), in
    ``ctx`` (a world-size-1 ``ParallelContext``) or a world of one started here."""
    device = resolve_device(args.device)
    spec = bench_spec(args.preset, args.prompt_len + args.max_len)
    batch = make_batch(
        spec.vocab_size, args.rows, args.prompt_len, args.min_len, args.max_len, args.seed
    )
    lengths = [int(n) for n in batch.attention_mask.sum(1).tolist()]
    budget = budget_for_packs(lengths, args.packs)
    num_mb = len(packed_micro_batches(batch, budget))
    own = ctx is None
    ctx = init_distributed(ParallelConfig(), spec, seed=args.seed) if own else ctx
    try:
        counts = {}
        for layers in (spec.num_layers, 1, 2):
            shape = dataclasses.replace(spec, num_layers=layers)
            counts[layers] = _Run(shape, ctx, args, batch, budget).count(args.top, device)
    finally:
        if own:
            destroy_distributed()
    full = counts[spec.num_layers]
    for phase in full:
        marginal = counts[2][phase]["ops"]["total"] - counts[1][phase]["ops"]["total"]
        full[phase]["ops"]["per_layer_per_micro_batch"] = marginal / num_mb
    return {
        "bench": "ops",
        "preset": args.preset,
        "device": device.type,
        "dtype": args.dtype,
        "fused_adam": args.fused_adam,
        "versions": package_versions("megatron-core"),
        "batch": {
            "rows": args.rows,
            "micro_batches": num_mb,
            "token_budget": budget,
            "tokens": sum(lengths),
            "layers": spec.num_layers,
        },
        "phases": full,
    }


OPS_WIDTHS = (-9, 9, 13, 11)
CUDA_WIDTHS = (14, 0)
"""On CUDA, two more columns: kernel launches, and ``/ host syncs`` as it is."""


def ops_table(res: dict) -> str:
    """The console table of ``run_bench_ops``'s result."""
    b, cuda = res["batch"], res["device"] == "cuda"  # every phase has "cuda" on CUDA
    head = [
        f"bench ops: preset {res['preset']} ({b['layers']} layers), {res['dtype']}, fused AdamW "
        f"{res['fused_adam']}, on {res['device']}, megatron-core {res['versions']['megatron-core']}, torch "
        f"{res['versions']['torch']}",
        f"batch: {b['rows']} rows, {b['tokens']} tokens in {b['micro_batches']} packs "
        f"(budget {b['token_budget']})",
        "",
    ]
    titles: tuple[str, ...] = ("phase", "ATen ops", "per layer/mb", "host syncs")
    widths: tuple[int, ...] = OPS_WIDTHS
    if cuda:
        titles, widths = titles + ("CUDA launches", "/ syncs"), widths + CUDA_WIDTHS
    rows = []
    for phase, c in res["phases"].items():
        cells: tuple[Any, ...] = (phase, c["ops"]["total"], f"{c['ops']['per_layer_per_micro_batch']:.1f}",
                 c["syncs"]["total"])  # fmt: skip
        if cuda:
            cells += (c["cuda"]["kernel_launches"], f"/ {c['cuda']['host_syncs']}")
        rows.append(cells)
    return format_table(titles, rows, widths, " ", head=head, foot=_top_lines(res))


def _top_lines(res: dict) -> list[str]:
    """Each phase's most frequent ops, their call sites and its host-sync-prone calls."""
    lines: list[str] = []
    for phase, c in res["phases"].items():
        for what, title in (("by_name", "top ops"), ("by_site", "top sites")):
            lines += ["", f"{phase}: {title}"]
            lines += [f"  {n:>6}  {k}" for k, n in c["ops"][what].items()]
        lines += ["", f"{phase}: host-sync-prone calls by site"]
        lines += [f"  {n:>6}  {k}" for k, n in c["syncs"]["by_site"].items()] or ["  (none)"]
    return lines
