"""``bench train``'s measurement (the command: ``bench/train/run.py``): FLOPs per token and the
device's peak, timed phases, tokens/s and MFU, the longest-sequence search, one side's
figures and the log-prob parity of the two."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from megatron_grpo.algorithms.step_batch import AdvantagedBatch, LossBatch
from megatron_grpo.bench.train.args import SEARCH_START, BenchTrainArgs
from megatron_grpo.bench.train.batch import add_loss_inputs, one_sequence
from megatron_grpo.models.spec import ModelSpec

GIB = float(1 << 30)

PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM: "NVIDIA H100 80GB HBM3"
    ("A100", 312.0),
)
"""Dense bf16 peak TFLOP/s (vendor datasheets, no sparsity) by a substring of
``torch.cuda.get_device_name()``, first match wins; ``--peak-tflops`` overrides it."""


def flop_params(spec: ModelSpec) -> int:
    """N of the 6N / 2N rule: the parameters of the matrix products a token goes through.
    The output layer counts (tied or not); the input embedding, a lookup, does not."""
    untied_embedding = 0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size
    return spec.num_parameters - untied_embedding


def attention_flops_forward(spec: ModelSpec, lengths: list[int]) -> int:
    """Causal attention's own forward FLOPs (scores and weighted sum, half of the s x s
    square each) over sequences of ``lengths``: ``2 * layers * heads * head_dim * s^2``."""
    d = spec.num_heads * spec.head_dim
    return sum(2 * spec.num_layers * d * s * s for s in lengths)


def known_peak_tflops(device_name: str) -> float | None:
    """The bf16 peak of a device named ``device_name`` in ``PEAK_BF16_TFLOPS``, or None."""
    return next((v for key, v in PEAK_BF16_TFLOPS if key in device_name), None)


def peak_tflops(device: torch.device, override: float | None) -> tuple[float | None, str]:
    """(peak TFLOP/s or None, the device's name)."""
    if device.type != "cuda":
        return override, "cpu"
    name = torch.cuda.get_device_name(device)
    return (override if override is not None else known_peak_tflops(name)), name


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed(fn: Callable[[], Any], warmup: int, steps: int, device: torch.device) -> dict:
    """Run ``fn`` ``warmup`` times untimed, then ``steps`` times timed. Returns the first
    call's result, the timed seconds and their median, and the peak memory of the timed
    calls (GiB; None on CPU)."""
    first = None
    for i in range(warmup):
        r = fn()
        first = r if i == 0 else first
    sync_device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(steps):
        t0 = time.perf_counter()
        r = fn()
        sync_device(device)
        seconds.append(time.perf_counter() - t0)
        first = r if first is None else first
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    return {
        "first": first,
        "seconds": seconds,
        "median_s": statistics.median(seconds),
        "peak_gib": peak,
    }


def phase_figures(
    t: dict, useful: int, flops: float, attn_flops: float, peak: float | None
) -> dict:
    """tokens/s and MFU of one timed phase (``flops``: FLOPs per useful token)."""
    rate = useful / t["median_s"]
    out = {
        "seconds": t["seconds"],
        "median_s": t["median_s"],
        "useful_tokens": useful,
        "useful_tokens_per_s": rate,
        "peak_gib": t["peak_gib"],
        "mfu": None,
        "mfu_with_attention": None,
    }
    if peak:
        out["mfu"] = rate * flops / (peak * 1e12)
        out["mfu_with_attention"] = (useful * flops + attn_flops) / t["median_s"] / (peak * 1e12)
    return out


def largest_trainable(
    try_length: Callable[[int], float | None],
    cap: int,
    free: Callable[[], None],
    start: int = SEARCH_START,
) -> dict:
    """Double the length from ``start`` up to ``cap`` while ``try_length(n)`` (one train
    step on one sequence of n tokens, returning its peak GiB) succeeds; a CUDA OOM ends the
    search. ``free()`` runs after every try, outside the ``except`` (the caught exception's
    traceback would otherwise keep the failed step's tensors alive)."""
    tried, largest, n = [], None, start
    while n <= cap:
        oom = False
        try:
            peak = try_length(n)
        except torch.OutOfMemoryError:
            oom, peak = True, None
        free()
        tried.append({"length": n, "ok": not oom, "peak_gib": peak})
        if oom:
            break
        largest, n = n, n * 2
    return {"largest": largest, "cap": cap, "tried": tried}


def train_one_sequence(
    side, loss_fn, args: BenchTrainArgs, device: torch.device, n: int
) -> float | None:
    """One train step of ``side`` on one sequence of ``n`` tokens (the length search's try);
    its peak GiB (None on CPU)."""
    one = one_sequence(side.spec.vocab_size, n, args.prompt_len, args.seed)
    logp = torch.zeros(one.input_ids.shape)
    loss_batch = add_loss_inputs(one, logp, args.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    side.train_step(loss_batch, loss_fn)
    sync_device(device)
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def measure_side(
    side,
    batch: AdvantagedBatch,
    loss_fn,
    args: BenchTrainArgs,
    device: torch.device,
    figures: dict,
    search: bool,
) -> dict:
    """Log-prob pass, then train step, then (``search``) the longest sequence, of one side.
    The train step's batch is ``batch`` when it is a ``LossBatch``, else ``batch`` with the
    loss inputs from this side's log-probs (returned as ``res["loss_batch"]``, for the next
    sides). A CUDA OOM in a phase is recorded (``oom``) and the side goes on with the next
    phase."""
    res: dict[str, Any] = {"num_parameters": side.num_parameters()}
    useful, lengths = figures["useful"], figures["lengths"]
    flop_n, peak = figures["flop_params"], figures["peak_tflops"]
    attn = attention_flops_forward(side.spec, lengths)
    oom_msg = (
        f"CUDA out of memory at micro-batch {args.micro_batch_size} x "
        f"{batch.input_ids.shape[1]} tokens: lower --micro-batch-size or --max-len"
    )
    free_memory(device)
    try:
        t = timed(lambda: side.logprobs(batch), args.warmup, args.steps, device)
        res["logprob"] = phase_figures(t, useful, 2 * flop_n, attn, peak)
        res["first_logp"] = t["first"]["logp"]
    except torch.OutOfMemoryError:
        res["logprob"] = {"oom": True, "error": oom_msg}
    free_memory(device)
    if not isinstance(batch, LossBatch):
        if "first_logp" not in res:
            raise RuntimeError(
                f"{side.name}: the log-prob pass failed ({oom_msg}); the train "
                "step needs its log-probs."
            )
        res["loss_batch"] = loss_batch = add_loss_inputs(batch, res["first_logp"], args.seed)
    else:
        loss_batch = batch
    try:
        t = timed(lambda: side.train_step(loss_batch, loss_fn), args.warmup, args.steps, device)
        res["train"] = phase_figures(t, useful, 6 * flop_n, 3 * attn, peak)
        res["first_step"] = t["first"]
    except torch.OutOfMemoryError:
        res["train"] = {"oom": True, "error": oom_msg}
    free_memory(device)
    if search:
        try_length = partial(train_one_sequence, side, loss_fn, args, device)
        res["largest_trainable"] = largest_trainable(
            try_length, args.search_cap, partial(free_memory, device)
        )
    return res


def rate_ratio(a: dict, b: dict, phase: str) -> float | None:
    """``a``'s useful tokens/s over ``b``'s in ``phase`` (None where either has no rate)."""
    pa, pb = a.get(phase, {}), b.get(phase, {})
    if "useful_tokens_per_s" in pa and "useful_tokens_per_s" in pb:
        return pa["useful_tokens_per_s"] / pb["useful_tokens_per_s"]
    return None


def logprob_parity(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict:
    """max and mean |a - b| over the tokens of ``mask`` (non-pad, position >= 1), and the
    mean of ``a`` there (a log-prob pass that returned zeros would show it)."""
    m = mask.clone()
    m[:, 0] = 0
    d = (a - b).abs()[m.bool()]
    return {
        "max_abs_diff": float(d.max()),
        "mean_abs_diff": float(d.mean()),
        "mean_logp": float(a[m.bool()].mean()),
        "tokens": d.numel(),
    }
