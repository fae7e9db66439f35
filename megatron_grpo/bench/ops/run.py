"""``megatron-grpo bench ops``: what one train step and one log-prob pass of the project's
policy ask of the device, counted (docs/benchmarks.md, "bench ops").

For a preset (``tiny`` by default; any preset on a GPU) and a seeded GRPO batch cut into
``packs`` packed micro-batches, in bf16 (fp32 main weights, as on a GPU): the ATen ops
dispatched (``bench.ops.count.OpCounter``) in total, per layer per micro-batch (the ops of a
2-layer model of the preset's shape less those of a 1-layer one, over the micro-batches),
the top ops and source sites; the host-sync-prone calls by site (``SyncCounter``); and on
CUDA the kernel launches and stream/device synchronizations of ``torch.profiler``. Each
phase is counted on its second call (the first builds the optimizer's state).

Each phase also gets its FLOPs per useful token against the model's 2N / 6N (+ attention)
(``count_flops``) and the train step its bytes saved for the backward pass per useful token,
in all and per layer (``SavedBytes``). ``--sides project,hf-packed`` (and ``hf``) counts
``bench train``'s Hugging Face anchors the same way on the same batch and weights
(``anchor.py``), ``--recompute none,full`` each with activation recompute off and on, and
adds the project/anchor ratio of each figure.

tests/bench/test_op_budget.py holds the tiny figures to ``tests/op_budget.json`` and to the
anchor's.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from megatron_grpo.algorithms.step_batch import AdvantagedBatch
from megatron_grpo.bench.common import format_table, package_versions
from megatron_grpo.bench.ops.anchor import SIDES, AnchorRun, padded_rows_per_micro_batch, ratios
from megatron_grpo.bench.ops.count import OpCounter, SavedBytes, SyncCounter, count_flops
from megatron_grpo.bench.train.args import bench_spec, resolve_device
from megatron_grpo.bench.train.batch import add_loss_inputs, grpo_loss_fn, make_batch
from megatron_grpo.bench.train.measure import attention_flops_forward, flop_params
from megatron_grpo.config.schema import ModelConfig, OptimConfig, ParallelConfig
from megatron_grpo.distributed import destroy_distributed, init_distributed
from megatron_grpo.layouts.io import gather_hf_state_dict
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
    sides: str = "project"
    """The sides counted, project first: ``hf`` (padded rows, SDPA) and ``hf-packed``
    (padding removed, the project's varlen attention), ``bench train``'s anchors."""
    recompute: str = "none"
    """``model.recompute`` settings counted, a comma list of none and full (the anchors:
    gradient checkpointing off and on)."""

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
        sides = self.sides.split(",")
        if sides[0] != "project" or not set(sides) <= set(SIDES) or len(set(sides)) != len(sides):
            raise ValueError(
                f"--sides={self.sides!r}: a comma list of {list(SIDES)} starting with project "
                "(the anchors load the project's weights)."
            )
        modes = self.recompute.split(",")
        if not set(modes) <= {"none", "full"} or len(set(modes)) != len(modes):
            raise ValueError(f"--recompute={self.recompute!r}: a comma list of none and full.")
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


KERNEL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "splitk")),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("optimizer", ("adam", "multi_tensor", "l2norm")),
    ("norm", ("rms", "norm")),
    ("copy", ("copy", "memcpy", "memset", "fill", "cat_", "index", "gather", "scatter")),
    ("reduce", ("reduce", "softmax", "logsumexp", "max", "sum")),
)
"""Kernel kinds by name fragment, first match wins (``kernel_kind``); the rest are
``elementwise`` (activations, casts, the loss's arithmetic, Triton's fused kernels)."""


def kernel_kind(name: str) -> str:
    """The kind of a CUDA kernel by its (demangled) name: where a step's device time goes."""
    low = name.lower()
    for kind, fragments in KERNEL_KINDS:
        if any(f in low for f in fragments):
            return kind
    return "elementwise"


def _profile_cuda(fn: Callable[[], Any], top: int = 12) -> dict:
    """Kernel launches and host synchronizations of one call of ``fn`` (torch.profiler), and
    where the device's time goes: the call's wall time, the kernels' summed time (``busy``:
    their share of the wall; the rest is the device idle, waiting for the host), by kind and
    the ``top`` kernels by time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
    launches = syncs = 0
    kinds: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            us = e.time_range.elapsed_us()
            kind = kernel_kind(e.name)
            kinds[kind] = kinds.get(kind, 0.0) + us
            name = e.name[:120]  # templated names run long; their head tells them apart
            kernels[name] = kernels.get(name, 0.0) + us
        elif e.name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel"):
            launches += 1
        elif e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"):
            syncs += 1
        elif e.name.startswith("cudaMemcpy") and "Async" not in e.name:
            syncs += 1
    device_ms = sum(kinds.values()) / 1e3
    return {
        "kernel_launches": launches,
        "host_syncs": syncs,
        "wall_ms": round(wall_us / 1e3, 3),
        "kernel_ms": round(device_ms, 3),
        "busy": round(device_ms / (wall_us / 1e3), 4) if wall_us else None,
        "kernel_ms_by_kind": {
            k: round(v / 1e3, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])
        },
        "top_kernels_ms": {
            k: round(v / 1e3, 3) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
        },
    }


def count_call(fn: Callable[[], Any], top: int, device: torch.device) -> dict:
    """The ops and host-sync-prone calls of one call of ``fn`` (and on CUDA the profiler's
    launches and syncs of another call)."""
    ops, syncs = OpCounter(), SyncCounter()
    with syncs, ops:
        fn()
    out = {"ops": ops.counts.to_dict(top), "syncs": syncs.counts.to_dict(top)}
    if device.type == "cuda":
        out["cuda"] = _profile_cuda(fn, top)
    return out


class _Run:
    """A policy of ``spec`` and the batch's two calls (log-prob pass, train step)."""

    def __init__(
        self,
        spec: ModelSpec,
        ctx,
        args: BenchOpsArgs,
        batch: AdvantagedBatch,
        budget: int,
        recompute: str = "none",
    ):
        model_cfg = ModelConfig(dtype=args.dtype, recompute=recompute)  # type: ignore[arg-type]
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

    def params(self) -> list[torch.Tensor]:
        return [p for _, p in self.policy.named_shards()]

    def close(self) -> None:
        del self.policy


def python_calls(fn: Callable[[], Any]) -> int:
    """The Python-level calls (functions and builtins) of one call of ``fn``, on every
    thread (the autograd engine's included): what the host runs around the ATen ops, which
    bounds a small model's GPU step (docs/benchmarks.md section 6: the device busy 46% of a
    0.5B step). Deterministic for an install, unlike a time on a shared machine."""
    n = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal n
        if event in ("call", "c_call"):
            n += 1

    threading.setprofile_all_threads(count)
    try:
        fn()
    finally:
        threading.setprofile_all_threads(None)
    return n


def count_side(run, top: int, device: torch.device) -> dict[str, dict]:
    """A side's two phases (``run.logprobs``, ``run.train_step``), each counted on calls
    after its first (which builds lazy state, the optimizer's moments): ops and host syncs,
    FLOPs, and for the train step the bytes saved for the backward pass."""
    out = {}
    for phase, fn in (("logprob", run.logprobs), ("train", run.train_step)):
        fn()
        out[phase] = count_call(fn, top, device)
        out[phase]["python"] = {"calls": python_calls(fn)}
        out[phase]["flops"] = {"total": count_flops(fn)}
        if phase == "train":
            with SavedBytes(run.params()) as saved:
                fn()
            out[phase]["saved_bytes"] = {"total": saved.bytes}
    return out


def _per_token(
    full: dict, one: dict, two: dict, spec: ModelSpec, lengths: list[int], num_mb: int
) -> dict:
    """``full`` (the side's counts at the preset's layers) with the per-layer and per-token
    figures: ops per layer per micro-batch, FLOPs per useful token against the model's
    (2N or 6N, + attention), saved bytes per useful token in all and per layer (the
    2-layer model's less the 1-layer one's)."""
    tokens = sum(lengths)
    attention = attention_flops_forward(spec, lengths) / tokens
    model = {
        "logprob": 2 * flop_params(spec) + attention,
        "train": 6 * flop_params(spec) + 3 * attention,
    }
    for phase, c in full.items():
        marginal = two[phase]["ops"]["total"] - one[phase]["ops"]["total"]
        c["ops"]["per_layer_per_micro_batch"] = marginal / num_mb
        calls = two[phase]["python"]["calls"] - one[phase]["python"]["calls"]
        c["python"]["per_layer_per_micro_batch"] = calls / num_mb
        c["flops"]["per_token"] = c["flops"]["total"] / tokens
        c["flops"]["model_per_token"] = model[phase]
        c["flops"]["over_model"] = c["flops"]["per_token"] / model[phase]
        if "saved_bytes" in c:
            layer = two[phase]["saved_bytes"]["total"] - one[phase]["saved_bytes"]["total"]
            c["saved_bytes"]["per_token"] = c["saved_bytes"]["total"] / tokens
            c["saved_bytes"]["per_token_per_layer"] = layer / tokens
    return full


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
    sides, modes = args.sides.split(","), args.recompute.split(",")
    padded_rows = padded_rows_per_micro_batch(args.rows, num_mb)
    micro_batches = {
        "project": num_mb,
        "hf-packed": num_mb,
        "hf": math.ceil(args.rows / padded_rows),
    }
    own = ctx is None
    ctx = init_distributed(ParallelConfig(), spec, seed=args.seed) if own else ctx
    counts: dict[tuple[str, str, int], dict] = {}
    try:
        for mode in modes:
            for layers in (spec.num_layers, 1, 2):
                shape = dataclasses.replace(spec, num_layers=layers)
                run = _Run(shape, ctx, args, batch, budget, mode)
                state = gather_hf_state_dict(run.policy.models, shape, ctx) if sides[1:] else {}
                counts["project", mode, layers] = count_side(run, args.top, device)
                run.close()
                for side in sides[1:]:
                    anchor = AnchorRun(side, shape, state, device, run.batch, budget, padded_rows,
                                       args.dtype, mode, fused_adam=_FUSED[args.fused_adam])  # fmt: skip
                    counts[side, mode, layers] = count_side(anchor, args.top, device)
                    anchor.close()
    finally:
        if own:
            destroy_distributed()
    by_side = {
        side: {
            mode: _per_token(
                counts[side, mode, spec.num_layers],
                counts[side, mode, 1],
                counts[side, mode, 2],
                spec,
                lengths,
                micro_batches[side],
            )  # fmt: skip
            for mode in modes
        }
        for side in sides
    }
    full = by_side["project"][modes[0]]
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
            "hf_rows_per_micro_batch": padded_rows,
        },
        "phases": full,
        "sides": by_side,
        "ratios": {
            side: {
                mode: ratios(full_p, by_side[side][mode])
                for mode, full_p in by_side["project"].items()
            }
            for side in sides[1:]
        },
    }


_FUSED = {"on": True, "off": False, "auto": None}
"""``--fused-adam`` as the anchors' AdamW takes it (None: fused on CUDA, as ``auto``)."""

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
    foot = _sides_lines(res) + (_device_time_lines(res) if cuda else []) + _top_lines(res)
    return format_table(titles, rows, widths, " ", head=head, foot=foot)


SIDE_TITLES = ("side", "recompute", "phase", "ops/layer/mb", "py/layer/mb", "host syncs",
               "FLOP/token", "x model", "saved B/token", "/layer")  # fmt: skip
SIDE_WIDTHS = (-10, -10, -8, 13, 12, 11, 13, 8, 14, 10)


def _sides_lines(res: dict) -> list[str]:
    """Each side's per-layer and per-token figures, then the project/anchor ratios."""
    rows: list[Any] = []
    for side, modes in res["sides"].items():
        for mode, phases in modes.items():
            for phase, c in phases.items():
                saved = c.get("saved_bytes", {})
                rows.append((side, mode, phase, f"{c['ops']['per_layer_per_micro_batch']:.1f}",
                             f"{c['python']['per_layer_per_micro_batch']:.0f}",
                             c["syncs"]["total"], f"{c['flops']['per_token']:.4g}",
                             f"{c['flops']['over_model']:.3f}",
                             f"{saved['per_token']:.0f}" if saved else "",
                             f"{saved['per_token_per_layer']:.0f}" if saved else ""))  # fmt: skip
    keys = ("ops_per_layer_per_micro_batch", "python_calls_per_layer_per_micro_batch",
            "host_syncs", "flops_per_token", None, "saved_bytes_per_token",
            "saved_bytes_per_token_per_layer")  # fmt: skip
    for side, modes in res["ratios"].items():
        for mode, phases in modes.items():
            for phase, r in phases.items():
                cells = [_ratio(r, k) for k in keys]
                rows.append((f"/ {side}", mode, phase, *cells))
    head = ["", "per useful token (x model: over 2N / 6N + attention); per layer: the 2-layer "
            "model less the 1-layer one; py: Python calls (the host's work "
            "around the ops); '/ side': project over that anchor"]  # fmt: skip
    return [format_table(SIDE_TITLES, rows, SIDE_WIDTHS, " ", head=head)]


def _device_time_lines(res: dict) -> list[str]:
    """On CUDA, each side's device time per phase: the call's wall time, the kernels' summed
    time and its share of the wall (``busy``), and the kernels' time by kind."""
    lines = ["", "device time per call (ms): wall, kernels (busy share), kernels by kind"]
    for side, modes in res["sides"].items():
        for mode, phases in modes.items():
            for phase, c in phases.items():
                d = c["cuda"]
                kinds = ", ".join(f"{k} {v:.1f}" for k, v in d["kernel_ms_by_kind"].items())
                lines.append(f"  {side:<10} {mode:<5} {phase:<8} {d['wall_ms']:9.1f} "
                             f"{d['kernel_ms']:9.1f} ({d['busy']:.0%})  {kinds}")  # fmt: skip
    return lines


def _ratio(ratios: dict, key: str | None) -> str:
    """A ratio cell: blank where the phase has no such figure, n/a where the anchor's is 0."""
    if key not in ratios:
        return ""
    x = ratios[key]
    return "n/a" if x is None else f"{x:.3f}x"


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
