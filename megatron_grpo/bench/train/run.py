"""``megatron-grpo bench train``: the project's policy against Hugging Face models of the
same shape (``hf``, and ``hf-packed``: padding removed, varlen attention, Liger where
installed), on the same GRPO batch and weights, on the same device, in one process.

The parts: ``train.args`` (the arguments, device and spec), ``train.batch`` (the batch),
``train.sides`` (the sides), ``train.measure`` (timing, MFU, the length search, parity) and
``train.table`` (the console table); this module runs them in order. No vLLM, ``datasets``
or ``math-verify`` is imported (tests/bench/test_bench_train.py blocks them). What each side
runs, the batch and the figures: docs/benchmarks.md §6.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_grpo.algorithms.step_batch import AdvantagedBatch, Rows
from megatron_grpo.bench.common import machine_info, package_versions
from megatron_grpo.bench.train.args import BenchTrainArgs, bench_spec, resolve_device
from megatron_grpo.bench.train.batch import grpo_loss_fn, make_batch, micro_batches
from megatron_grpo.bench.train.measure import (
    GIB,
    flop_params,
    free_memory,
    logprob_parity,
    measure_side,
    peak_tflops,
    rate_ratio,
)
from megatron_grpo.bench.train.sides import HFSide, ProjectSide
from megatron_grpo.config.schema import ModelConfig, ParallelConfig
from megatron_grpo.distributed import distributed_context
from megatron_grpo.models.spec import ModelSpec
from megatron_grpo.policy.model_builder import resolve_dtype


def run_bench_train(args: BenchTrainArgs) -> dict:
    """Both sides on one batch, one after the other (the project first, freed before the HF
    model is built, so each side's peak memory is its own). Returns the result dict."""
    device = resolve_device(args.device)
    search = args.search == "on" or (args.search == "auto" and device.type == "cuda")
    longest = max(args.prompt_len + args.max_len, args.search_cap if search else 0)
    spec = bench_spec(args.preset, longest)
    dtype = resolve_dtype(ModelConfig(dtype=args.dtype), device)
    peak, device_name = peak_tflops(device, args.peak_tflops)
    batch = make_batch(
        spec.vocab_size, args.rows, args.prompt_len, args.min_len, args.max_len, args.seed
    )
    figures = batch_figures(batch, spec, peak)
    sides, leftover = measure_sides(spec, batch, args, device, dtype, figures, search)
    parity = pop_parity(sides, batch)
    return {
        "bench": "train",
        "preset": args.preset,
        "device": device.type,
        "device_name": device_name,
        "dtype": str(dtype).removeprefix("torch."),
        "versions": package_versions("transformers", "megatron-core"),
        "spec": spec.to_dict(),
        "flop_params": figures["flop_params"],
        "flops_per_token": {
            "train": 6 * figures["flop_params"],
            "logprob": 2 * figures["flop_params"],
        },
        "attention_flops_included": False,
        "peak_tflops": peak,
        "batch": batch_summary(args, batch, figures),
        "warmup": args.warmup,
        "steps": args.steps,
        "search": search,
        "sides": sides,
        "ratio": ratios(sides),
        "logprob_parity": parity,
        "gib_left_after_project": leftover,
        "machine": machine_info(),
    }


def batch_figures(batch: Rows, spec: ModelSpec, peak: float | None) -> dict:
    """What ``measure_side`` needs of the batch and the model: the useful (non-pad) tokens,
    the sequence lengths, N of the 6N / 2N rule and the device's peak TFLOP/s."""
    assert batch.attention_mask is not None
    lengths = [int(n) for n in batch.attention_mask.sum(1).tolist()]
    return {
        "useful": sum(lengths),
        "lengths": lengths,
        "flop_params": flop_params(spec),
        "peak_tflops": peak,
    }


def measure_sides(
    spec: ModelSpec,
    batch: AdvantagedBatch,
    args: BenchTrainArgs,
    device: torch.device,
    dtype: torch.dtype,
    figures: dict,
    search: bool,
) -> tuple[dict[str, dict], float | None]:
    """The project side, then each HF side (``--sides``) loaded with the project's initial
    weights, each freed before the next is built. Returns the sides' figures and the GiB
    still allocated after the project side was freed (None on CPU)."""
    loss_fn = grpo_loss_fn()
    sides: dict[str, dict] = {}
    with distributed_context(ParallelConfig(), spec, seed=args.seed) as ctx:
        project = ProjectSide(spec, ctx, args)
        state = project.hf_state_dict()
        shards = project.shards() if "project-padded" in args.sides.split(",") else None
        sides["project"] = measure_side(project, batch, loss_fn, args, device, figures, search)
        batch = sides["project"].pop("loss_batch", batch)  # every side trains on the same
        sides["project"]["liger"] = project.kernels.layer_fns == "liger"
        project.close()
        del project
        free_memory(device)
        leftover = torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None
        for name in args.sides.split(",")[1:]:
            if name == "project-padded":  # the project's initial weights, padded rows
                padded = ProjectSide(spec, ctx, args, padded=True, shards=shards)
                sides[name] = measure_side(padded, batch, loss_fn, args, device, figures, search)
                batch = sides[name].pop("loss_batch", batch)
                sides[name]["liger"] = padded.kernels.layer_fns == "liger"
                padded.close()
                del padded
                free_memory(device)
                continue
            budget = hf_packed_budget(args) if name == "hf-packed" else None
            hf = HFSide(spec, state, device, dtype, args, packed_budget=budget)
            sides[name] = measure_side(hf, batch, loss_fn, args, device, figures, search)
            batch = sides[name].pop("loss_batch", batch)
            sides[name]["liger"] = hf.liger
            hf.close()
            del hf
            free_memory(device)
    return sides, leftover


def hf_packed_budget(args: BenchTrainArgs) -> int:
    """The ``hf-packed`` side's token budget: the project's (its default when the project
    runs padded rows)."""
    own = ProjectSide.budget_of(args)
    if own is not None:
        return own
    default = ProjectSide.budget_of(dataclasses.replace(args, micro_batch_tokens=None))
    assert default is not None, "micro_batch_tokens=None: padded rows' budget"
    return default


def ratios(sides: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    """The project's tokens/s over each other side's, per phase (``hf`` also under the old
    flat ``train`` / ``logprob`` keys)."""
    p = sides["project"]
    out: dict = {}
    for name, side in sides.items():
        if name != "project":
            out[name] = {ph: rate_ratio(p, side, ph) for ph in ("train", "logprob")}
    out.update(out.get("hf", {}))
    return out


def pop_parity(sides: dict[str, dict], batch: Rows) -> dict[str, dict | None] | None:
    """Log-prob parity on the same weights (None where a side's log-prob pass failed):
    ``project`` vs ``hf`` under the old flat keys, and ``hf-packed`` vs ``hf``; the first
    log-probs are taken out of the result."""
    first = {n: s.pop("first_logp", None) for n, s in sides.items()}
    mask = batch.attention_mask

    def parity(a: str, b: str):
        if first.get(a) is None or first.get(b) is None:
            return None
        assert mask is not None  # the bench's batch (bench/train/batch.py) always has one
        return logprob_parity(first[a], first[b], mask)

    out = parity("project", "hf") or parity("project", "hf-packed") or {}
    if "hf-packed" in sides:
        out = {**out, "hf-packed_vs_hf": parity("hf-packed", "hf")}
    return out or None


def batch_summary(args: BenchTrainArgs, batch: AdvantagedBatch, figures: dict) -> dict:
    """The result's ``batch`` entry: the batch's arguments and token counts."""
    padded = sum(len(mb[2].input_ids) * mb[1] for mb in micro_batches(batch, args.micro_batch_size))
    return {
        "rows": args.rows,
        "prompt_len": args.prompt_len,
        "min_len": args.min_len,
        "max_len": args.max_len,
        "seq_len": int(batch.input_ids.shape[1]),
        "useful_tokens": figures["useful"],
        "response_tokens": int(batch.loss_mask.sum()),
        "padded_tokens": padded,
        "micro_batch_size": args.micro_batch_size,
        "recompute": args.recompute,
        "project_micro_batch_tokens": ProjectSide.budget_of(args),
        "hf_packed_micro_batch_tokens": hf_packed_budget(args),
        "seed": args.seed,
    }
