"""``megatron-grpo bench train``: the project's policy against a plain Hugging Face model of
the same shape, on the same GRPO batch, on the same device, in one process.

The two sides (docs/benchmarks.md, "bench train"):

- **project**: ``policy.build_policy`` at world size 1 (``Policy.compute_logprobs`` and
  ``Policy.train_step``: megatron-core GPTModel, DDP, megatron's optimizer; bf16 on GPU with
  fp32 main weights, fp32 on CPU).
- **hf**: ``transformers``' ``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` / ``Qwen3ForCausalLM``
  built from the same ``ModelSpec``, ``attn_implementation="sdpa"``, the model's weights in
  the bench's dtype (bf16 on GPU: weights, gradients and AdamW moments all bf16, no fp32 master
  copy), ``torch.optim.AdamW(fused=True)`` on CUDA, ``clip_grad_norm_`` at the same clip:
  what an FSDP/TRL user runs without extra installs. Micro-batches are the same rows, each
  trimmed to its own longest sequence (right padding: causal attention needs no mask).

Both start from the same weights: the project's initial weights are converted to HF names
by ``layouts.io.gather_hf_state_dict`` and loaded into the HF model, so the log-prob pass of
the two sides must agree (``logprob_parity`` in the result; fp32 on CPU agrees to ~1e-6).
Both compute log-probs and entropies with the same function (``policy.logprob.token_logprobs``)
and the same GRPO loss (``algorithms.aggregation.make_loss_fn``: clipped surrogate, k3 KL,
token-mean), so the comparison isolates the model, its attention, and the optimizer.

The batch (``make_batch``): ``rows`` sequences, prompts of ~``prompt_len`` tokens (uniform in
``[7/8 prompt_len, prompt_len]``), responses uniform in ``[min_len, max_len]`` (seeded),
right-padded to the longest. The log-prob pass runs first; its log-probs become the batch's
``old_logp`` / ``ref_logp``, and ``rollout_logp`` is them plus N(0, 0.05) noise (a lagged
policy), as in a GRPO step.

Figures per side and phase: median seconds of ``steps`` timed repeats after ``warmup``
untimed ones, useful (non-pad) tokens/s, MFU at ``6N`` (train) / ``2N`` (log-prob) FLOPs per
useful token with N the parameters of the matrix products (attention's own FLOPs not
included; ``mfu_with_attention`` adds them), peak memory (``torch.cuda.max_memory_allocated``
since the end of the warm-up; None on CPU). And per side, the longest single sequence that
trains: lengths 1024, 2048, ... up to ``search_cap``, stopping at the first CUDA OOM.

Imports: torch, transformers, megatron-core and the project's own modules, none of vLLM,
``datasets`` or ``math-verify`` (tests/test_bench_train.py runs the command with them blocked).
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_grpo.algorithms.aggregation import compute_global_normalizers, make_loss_fn
from megatron_grpo.bench.common import machine_info
from megatron_grpo.config.schema import GRPOConfig, ModelConfig, OptimConfig, ParallelConfig
from megatron_grpo.distributed import destroy_distributed, init_distributed
from megatron_grpo.layouts import hf as hf_names
from megatron_grpo.layouts import megatron as mg_names
from megatron_grpo.layouts.io import gather_hf_state_dict
from megatron_grpo.models.shapes import preset_spec
from megatron_grpo.models.spec import ModelSpec
from megatron_grpo.models.tiny import hf_config_dict
from megatron_grpo.policy.logprob import token_logprobs
from megatron_grpo.policy.model_builder import resolve_dtype
from megatron_grpo.policy.policy import build_policy

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

SEARCH_START = 1024
"""First length of the largest-sequence search; it doubles from there."""

LOGP_NOISE = 0.05
"""Std of the noise that makes ``rollout_logp`` differ from the trainer's log-probs."""


@dataclass
class BenchTrainArgs:
    preset: str = "tiny"
    """A preset of ``models/tiny.py`` (tiny, Qwen2.5-0.5B, Qwen2.5-1.5B, Qwen2.5-7B)."""
    rows: int = 32
    """Sequences in the batch."""
    prompt_len: int = 256
    """Longest prompt; prompts are uniform in [7/8 of it, it]."""
    min_len: int = 64
    """Shortest response (responses are uniform in [min_len, max_len])."""
    max_len: int = 1024
    """Longest response."""
    micro_batch_size: int = 4
    micro_batch_tokens: int | None = None
    """The project side's token budget per packed micro-batch (``grpo.micro_batch_tokens``);
    None: the trainer's default, ``micro_batch_size * (prompt_len + max_len)``; 0: padded
    rows of ``micro_batch_size`` like the HF side (``grpo.pack_sequences=false``)."""
    recompute: str = "none"
    """Activation recomputation on both sides: ``full`` is the project's
    ``model.recompute=full`` and HF's ``gradient_checkpointing_enable()``."""
    steps: int = 5
    """Timed repeats per phase (the median is reported)."""
    warmup: int = 2
    """Untimed repeats before them."""
    device: str = "auto"
    """``auto`` (cuda when available), ``cuda`` or ``cpu``."""
    dtype: str = "auto"
    """``auto`` (bf16 on GPU, fp32 on CPU), ``bfloat16`` or ``float32``: both sides."""
    peak_tflops: float | None = None
    """Device peak for MFU; default from ``PEAK_BF16_TFLOPS`` (None on CPU: MFU n/a)."""
    search: str = "auto"
    """Largest trainable sequence search: ``auto`` (on GPU only), ``on`` or ``off``."""
    search_cap: int = 32768
    """Longest sequence the search tries."""
    seed: int = 0
    lr: float = 1e-6

    def __post_init__(self) -> None:
        for k in ("rows", "prompt_len", "min_len", "max_len", "micro_batch_size", "steps"):
            if getattr(self, k) < 1:
                raise ValueError(f"--{k.replace('_', '-')}={getattr(self, k)} must be >= 1.")
        if self.warmup < 0:
            raise ValueError(f"--warmup={self.warmup} must be >= 0.")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 0:
            raise ValueError(
                f"--micro-batch-tokens={self.micro_batch_tokens} must be >= 0 (0: padded rows)."
            )
        if self.min_len > self.max_len:
            raise ValueError(
                f"--min-len={self.min_len} > --max-len={self.max_len}: responses are drawn "
                "from [min-len, max-len]; lower --min-len or raise --max-len."
            )
        choices = {
            "device": ("auto", "cuda", "cpu"),
            "dtype": ("auto", "bfloat16", "float32"),
            "search": ("auto", "on", "off"),
            "recompute": ("none", "full"),
        }
        for k, allowed in choices.items():
            if getattr(self, k) not in allowed:
                raise ValueError(f"--{k}={getattr(self, k)!r}: choose one of {list(allowed)}.")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"--peak-tflops={self.peak_tflops} must be > 0.")
        if self.search_cap < SEARCH_START:
            raise ValueError(f"--search-cap={self.search_cap} must be >= {SEARCH_START}.")
        preset_spec(self.preset)  # ConfigError naming the presets
        resolve_dtype(ModelConfig(dtype=self.dtype), resolve_device(self.device))


# --------------------------------------------------------------------------------- setup
def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available. ``cpu`` is refused on a CUDA machine: the project's
    CPU platform layer (platform/cpu.py) applies only where no CUDA device is present."""
    cuda = torch.cuda.is_available()
    if name == "cuda" and not cuda:
        raise ValueError("--device cuda, but torch sees no CUDA device: use --device cpu.")
    if name == "cpu" and cuda:
        raise ValueError(
            "--device cpu on a machine with CUDA: the project's CPU layer applies only without "
            "a CUDA device; run with CUDA_VISIBLE_DEVICES= to bench on the CPU."
        )
    return torch.device("cuda" if cuda else "cpu")


def bench_spec(preset: str, longest: int) -> ModelSpec:
    """The preset's spec, with ``max_position_embeddings`` at least ``longest`` (RoPE has no
    learned positions; the presets' config value is only a default)."""
    spec = preset_spec(preset)
    if spec.max_position_embeddings < longest:
        spec = dataclasses.replace(spec, max_position_embeddings=longest)
    return spec


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


# --------------------------------------------------------------------------------- batch
def make_batch(
    vocab_size: int, rows: int, prompt_len: int, min_len: int, max_len: int, seed: int
) -> dict[str, torch.Tensor]:
    """A right-padded GRPO batch on the CPU: ``input_ids``, ``attention_mask`` (1 on real
    tokens), ``loss_mask`` and ``response_mask`` (1 on response tokens), ``advantages``
    (whitened normal, one per row). Token ids avoid the three special ids of the tiny
    tokenizer."""
    g = torch.Generator().manual_seed(seed)
    lo = max(1, prompt_len - prompt_len // 8)
    prompts = torch.randint(lo, prompt_len + 1, (rows,), generator=g).tolist()
    responses = torch.randint(min_len, max_len + 1, (rows,), generator=g).tolist()
    length = max(p + r for p, r in zip(prompts, responses))
    ids = torch.zeros(rows, length, dtype=torch.long)
    attn = torch.zeros(rows, length)
    resp = torch.zeros(rows, length)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids[b, : p + r] = torch.randint(3, vocab_size, (p + r,), generator=g)
        attn[b, : p + r] = 1
        resp[b, p : p + r] = 1
    adv = torch.randn(rows, generator=g)
    adv = (adv - adv.mean()) / adv.std().clamp(min=1e-6) if rows > 1 else adv
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "loss_mask": resp,
        "response_mask": resp.clone(),
        "advantages": adv,
    }


def add_loss_inputs(batch: dict, logp: torch.Tensor, seed: int) -> dict:
    """The batch with what the GRPO loss reads: ``old_logp`` and ``ref_logp`` (the log-prob
    pass's ``logp``), ``rollout_logp`` (the same plus noise, on response tokens) and the
    global normalizers of a one-rank mini-batch."""
    g = torch.Generator().manual_seed(seed + 1)
    mask = batch["loss_mask"]
    noise = torch.randn(logp.shape, generator=g) * LOGP_NOISE
    out = dict(
        batch, old_logp=logp * mask, ref_logp=logp * mask, rollout_logp=(logp + noise) * mask
    )
    out.update(compute_global_normalizers(mask))
    return out


def grpo_loss_fn():
    """The clipped off-policy surrogate with a k3 KL term (beta 0.1, the paper's GSM8K
    setup) and token-mean aggregation, built once as the trainer builds it."""
    return make_loss_fn(GRPOConfig(kl_coef=0.1))


def micro_batches(batch: dict, size: int) -> list[tuple[slice, int, dict]]:
    """(rows, trimmed length, micro-batch) of ``size`` rows in order, each trimmed to its
    own longest sequence (the padded path of ``Policy``; right padding needs no mask)."""
    b, seq = batch["input_ids"].shape
    out = []
    for start in range(0, b, size):
        rows = slice(start, min(start + size, b))
        nz = batch["attention_mask"][rows].nonzero()
        length = max(int(nz[:, 1].max()) + 1 if len(nz) else 1, 2)
        mb = {}
        for k, v in batch.items():
            t = v[rows] if v.dim() >= 1 else v
            mb[k] = t[:, :length].contiguous() if t.dim() >= 2 and t.shape[1] == seq else t
        out.append((rows, length, mb))
    return out


# --------------------------------------------------------------------------------- sides
class ProjectSide:
    """The project's ``Policy`` at world size 1."""

    name = "project"

    def __init__(self, spec: ModelSpec, ctx, args: BenchTrainArgs) -> None:
        self.spec, self.args = spec, args
        model_cfg = ModelConfig(dtype=args.dtype, recompute=args.recompute)
        self.policy = build_policy(spec, ctx, model_cfg, OptimConfig(lr=args.lr), temperature=1.0)
        self.ctx = ctx

    def sizes(self) -> dict[str, Any]:
        """How the policy splits a batch: packed micro-batches of at most
        ``token_budget`` real tokens, as the trainer runs it (or padded rows, budget 0)."""
        return {
            "micro_batch_size": self.args.micro_batch_size,
            "token_budget": self.budget_of(self.args),
        }

    @staticmethod
    def budget_of(a: BenchTrainArgs) -> int | None:
        """The project side's token budget (None: padded rows of ``micro_batch_size``)."""
        if a.micro_batch_tokens is None:
            return a.micro_batch_size * (a.prompt_len + a.max_len)
        return a.micro_batch_tokens or None

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The current weights under HF names, as full CPU tensors."""
        return gather_hf_state_dict(self.policy.models, self.spec, self.ctx)

    def num_parameters(self) -> int:
        """Parameters without megatron's vocabulary padding rows (HF's count)."""
        n = 0
        for name, p in self.policy.named_shards():
            n += p.numel()
            if name.endswith((mg_names.EMBEDDING, mg_names.OUTPUT)):
                n -= (p.shape[0] - self.spec.vocab_size) * p.shape[1]
        return n

    def logprobs(self, batch: dict) -> dict[str, torch.Tensor]:
        return self.policy.compute_logprobs(batch, **self.sizes())

    def train_step(self, batch: dict, loss_fn) -> dict[str, float]:
        m = self.policy.train_step(batch, loss_fn, **self.sizes())
        return {"loss": m["loss"], "grad_norm": m["grad_norm"]}

    def close(self) -> None:
        self.policy = None


class HFSide:
    """A plain ``transformers`` causal LM of the same spec, SDPA attention, AdamW."""

    name = "hf"

    def __init__(
        self,
        spec: ModelSpec,
        state: dict,
        device: torch.device,
        dtype: torch.dtype,
        args: BenchTrainArgs,
    ) -> None:
        import transformers

        self.spec, self.args, self.device = spec, args, device
        cfg = hf_config_dict(
            {
                "architecture": spec.architecture,
                "hidden_size": spec.hidden_size,
                "num_hidden_layers": spec.num_layers,
                "num_attention_heads": spec.num_heads,
                "num_key_value_heads": spec.num_kv_heads,
                "head_dim": spec.head_dim,
                "intermediate_size": spec.ffn_hidden_size,
                "tie_word_embeddings": spec.tie_word_embeddings,
                "rope_theta": spec.rope_theta,
                "rms_norm_eps": spec.rms_norm_eps,
                "max_position_embeddings": spec.max_position_embeddings,
            },
            vocab_size=spec.vocab_size,
        )
        config = transformers.AutoConfig.for_model(
            **{k: v for k, v in cfg.items() if k != "architectures"}
        )
        config.architectures = cfg["architectures"]
        config.use_cache = False
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation="sdpa", dtype=dtype
            )
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied_head = [hf_names.LM_HEAD] if spec.tie_word_embeddings else []
        if unexpected or [k for k in missing if k not in tied_head]:
            raise ValueError(
                f"HF model and the project's weights disagree: missing {missing[:4]}, "
                f"unexpected {unexpected[:4]}"
            )
        if args.recompute == "full":
            model.gradient_checkpointing_enable()
        self.model = model
        opt = OptimConfig(lr=args.lr)
        self.clip = opt.clip_grad
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=opt.lr,
            betas=(opt.adam_beta1, opt.adam_beta2),
            eps=opt.adam_eps,
            weight_decay=opt.weight_decay,
            fused=device.type == "cuda",
        )

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())  # tied weights counted once

    def _logp_entropy(self, ids: torch.Tensor):
        logits = self.model(input_ids=ids, use_cache=False).logits
        return token_logprobs(logits, ids, vocab_start=0, vocab_size=self.spec.vocab_size)

    @torch.no_grad()
    def logprobs(self, batch: dict) -> dict[str, torch.Tensor]:
        """Like ``Policy.compute_logprobs``: [B, L] fp32 on the CPU, 0 on padding."""
        self.model.eval()
        out = torch.zeros(2, *batch["input_ids"].shape, device=self.device)
        for rows, length, mb in micro_batches(batch, self.args.micro_batch_size):
            logp, ent = self._logp_entropy(mb["input_ids"].to(self.device))
            out[0, rows, :length] = logp.float()
            out[1, rows, :length] = ent.float()
        out *= batch["attention_mask"].to(self.device)
        out = out.cpu()
        return {"logp": out[0], "entropy": out[1]}

    def train_step(self, batch: dict, loss_fn) -> dict[str, float]:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for _, _, mb in micro_batches(batch, self.args.micro_batch_size):
            dev = {k: v.to(self.device) for k, v in mb.items()}
            logp, ent = self._logp_entropy(dev["input_ids"])
            loss, _ = loss_fn(logp, ent, dev)
            loss.backward()
            total += loss.detach().float()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        return {"loss": float(total), "grad_norm": float(grad_norm)}

    def close(self) -> None:
        self.model = self.optimizer = None


# ----------------------------------------------------------------------------- measuring
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
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
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(steps):
        t0 = time.perf_counter()
        r = fn()
        _sync(device)
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


def one_sequence(vocab_size: int, length: int, prompt_len: int, seed: int) -> dict:
    """A batch of one sequence of exactly ``length`` tokens, its first
    ``min(prompt_len, length // 2)`` the prompt (what the length search trains)."""
    g = torch.Generator().manual_seed(seed)
    resp = torch.zeros(1, length)
    resp[:, min(prompt_len, length // 2) :] = 1
    ids = torch.randint(3, vocab_size, (1, length), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones(1, length),
        "loss_mask": resp,
        "response_mask": resp.clone(),
        "advantages": torch.ones(1),
    }


def measure_side(
    side,
    batch: dict,
    loss_fn,
    args: BenchTrainArgs,
    device: torch.device,
    figures: dict,
    search: bool,
) -> dict:
    """Log-prob pass, then train step, then (``search``) the longest sequence, of one side.
    Fills ``batch`` with the loss inputs from the first side's log-probs when absent. A CUDA
    OOM in a phase is recorded (``oom``) and the side goes on with the next phase."""
    res: dict[str, Any] = {"num_parameters": side.num_parameters()}
    useful, lengths = figures["useful"], figures["lengths"]
    flop_n, peak = figures["flop_params"], figures["peak_tflops"]
    attn = attention_flops_forward(side.spec, lengths)
    oom_msg = (
        f"CUDA out of memory at micro-batch {args.micro_batch_size} x "
        f"{batch['input_ids'].shape[1]} tokens: lower --micro-batch-size or --max-len"
    )
    _free(device)
    try:
        t = timed(lambda: side.logprobs(batch), args.warmup, args.steps, device)
        res["logprob"] = phase_figures(t, useful, 2 * flop_n, attn, peak)
        res["first_logp"] = t["first"]["logp"]
    except torch.OutOfMemoryError:
        res["logprob"] = {"oom": True, "error": oom_msg}
    _free(device)
    if "old_logp" not in batch:
        if "first_logp" not in res:
            raise RuntimeError(
                f"{side.name}: the log-prob pass failed ({oom_msg}); the train "
                "step needs its log-probs."
            )
        batch.update(add_loss_inputs(batch, res["first_logp"], args.seed))
    try:
        t = timed(lambda: side.train_step(batch, loss_fn), args.warmup, args.steps, device)
        res["train"] = phase_figures(t, useful, 6 * flop_n, 3 * attn, peak)
        res["first_step"] = t["first"]
    except torch.OutOfMemoryError:
        res["train"] = {"oom": True, "error": oom_msg}
    _free(device)
    if search:

        def try_length(n: int) -> float | None:
            one = one_sequence(side.spec.vocab_size, n, args.prompt_len, args.seed)
            logp = torch.zeros(one["input_ids"].shape)
            one = add_loss_inputs(one, logp, args.seed)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            side.train_step(one, loss_fn)
            _sync(device)
            return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None

        res["largest_trainable"] = largest_trainable(
            try_length, args.search_cap, lambda: _free(device)
        )
    return res


def _ratio(a: dict, b: dict, phase: str) -> float | None:
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


def _versions() -> dict:
    import importlib.metadata as md

    out = {"torch": torch.__version__}
    for dist_name in ("transformers", "megatron-core"):
        try:
            out[dist_name] = md.version(dist_name)
        except md.PackageNotFoundError:
            out[dist_name] = None
    return out


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
    lengths = [int(n) for n in batch["attention_mask"].sum(1).tolist()]
    padded = sum(
        len(mb[2]["input_ids"]) * mb[1] for mb in micro_batches(batch, args.micro_batch_size)
    )
    figures = {
        "useful": sum(lengths),
        "lengths": lengths,
        "flop_params": flop_params(spec),
        "peak_tflops": peak,
    }
    loss_fn = grpo_loss_fn()
    ctx = init_distributed(ParallelConfig(), spec, seed=args.seed)
    sides: dict[str, dict] = {}
    try:
        project = ProjectSide(spec, ctx, args)
        state = project.hf_state_dict()
        sides["project"] = measure_side(project, batch, loss_fn, args, device, figures, search)
        project.close()
        del project
        _free(device)
        leftover = torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None
        hf = HFSide(spec, state, device, dtype, args)
        del state
        sides["hf"] = measure_side(hf, batch, loss_fn, args, device, figures, search)
        hf.close()
        del hf
        _free(device)
    finally:
        destroy_distributed()
    parity = None
    if "first_logp" in sides["project"] and "first_logp" in sides["hf"]:
        parity = logprob_parity(
            sides["project"].pop("first_logp"),
            sides["hf"].pop("first_logp"),
            batch["attention_mask"],
        )
    for s in sides.values():
        s.pop("first_logp", None)
    p, h = sides["project"], sides["hf"]
    return {
        "bench": "train",
        "preset": args.preset,
        "device": device.type,
        "device_name": device_name,
        "dtype": str(dtype).removeprefix("torch."),
        "versions": _versions(),
        "spec": spec.to_dict(),
        "flop_params": figures["flop_params"],
        "flops_per_token": {
            "train": 6 * figures["flop_params"],
            "logprob": 2 * figures["flop_params"],
        },
        "attention_flops_included": False,
        "peak_tflops": peak,
        "batch": {
            "rows": args.rows,
            "prompt_len": args.prompt_len,
            "min_len": args.min_len,
            "max_len": args.max_len,
            "seq_len": int(batch["input_ids"].shape[1]),
            "useful_tokens": figures["useful"],
            "response_tokens": int(batch["loss_mask"].sum()),
            "padded_tokens": padded,
            "micro_batch_size": args.micro_batch_size,
            "recompute": args.recompute,
            "project_micro_batch_tokens": ProjectSide.budget_of(args),
            "seed": args.seed,
        },
        "warmup": args.warmup,
        "steps": args.steps,
        "search": search,
        "sides": sides,
        "ratio": {"train": _ratio(p, h, "train"), "logprob": _ratio(p, h, "logprob")},
        "logprob_parity": parity,
        "gib_left_after_project": leftover,
        "machine": machine_info(),
    }


# --------------------------------------------------------------------------------- table
def _packing(budget: int | None) -> str:
    return f"packed, {budget:,} tokens per micro-batch" if budget else "padded rows"


def _num(x: float | None, fmt: str, na: str = "n/a") -> str:
    return na if x is None else format(x, fmt)


def format_table(res: dict) -> str:
    b, spec = res["batch"], res["spec"]
    peak = res["peak_tflops"]
    lines = [
        f"bench train: {res['preset']} ({res['sides']['project']['num_parameters'] / 1e6:.1f}M "
        f"params, {spec['num_layers']} layers), {res['device_name']}, {res['dtype']}, peak "
        f"{_num(peak, '.0f')} TFLOP/s",
        f"batch: {b['rows']} rows, prompts ~{b['prompt_len']}, responses {b['min_len']}.."
        f"{b['max_len']} (seed {b['seed']}): {b['useful_tokens']:,} useful tokens, "
        f"{b['padded_tokens']:,} padded; micro-batch {b['micro_batch_size']} rows (project: "
        f"{_packing(b['project_micro_batch_tokens'])}); median of "
        f"{res['steps']} after {res['warmup']} warm-up",
        f"{'':<12}{'train step':^40}{'log-prob pass':^40}",
        f"{'side':<12}"
        + f"{'s':>9}{'tok/s':>11}{'MFU 6N':>9}{'peak GiB':>11}"
        + f"{'s':>9}{'tok/s':>11}{'MFU 2N':>9}{'peak GiB':>11}",
    ]

    def cells(d: dict) -> str:
        if d.get("oom"):
            return f"{'CUDA OOM':>40}"
        mfu = None if d["mfu"] is None else 100 * d["mfu"]
        return (
            f"{d['median_s']:>9.4f}{d['useful_tokens_per_s']:>11,.0f}"
            f"{_num(mfu, '.1f') + ('%' if mfu is not None else ''):>9}"
            f"{_num(d['peak_gib'], '.2f'):>11}"
        )

    for name, s in res["sides"].items():
        lines.append(f"{name:<12}" + cells(s["train"]) + cells(s["logprob"]))
    r = res["ratio"]
    lines.append(
        f"{'project/hf':<12}{_num(r['train'], '.2f') + 'x tokens/s':>40}"
        f"{_num(r['logprob'], '.2f') + 'x tokens/s':>40}"
    )
    if res["search"]:
        parts = []
        for name, s in res["sides"].items():
            ls = s["largest_trainable"]
            fail = [t["length"] for t in ls["tried"] if not t["ok"]]
            ok = [t for t in ls["tried"] if t["ok"]]
            at = f" ({ok[-1]['peak_gib']:.1f} GiB)" if ok and ok[-1]["peak_gib"] else ""
            end = f", {fail[0]:,} OOM" if fail else f", cap {ls['cap']:,}"
            parts.append(f"{name} {_num(ls['largest'], ',')}{at}{end}")
        lines.append("largest sequence that trains: " + "; ".join(parts))
    par = res["logprob_parity"]
    if par:
        lines.append(
            f"log-prob parity on the same initial weights: max |diff| "
            f"{par['max_abs_diff']:.2e}, mean {par['mean_abs_diff']:.2e} over "
            f"{par['tokens']:,} tokens"
        )
    fs = {n: s.get("first_step") for n, s in res["sides"].items()}
    if all(fs.values()):
        lines.append(
            "first step: "
            + "; ".join(
                f"{n} loss {v['loss']:.6f} grad norm {v['grad_norm']:.6f}" for n, v in fs.items()
            )
        )
    lines.append(
        f"MFU: {res['flop_params'] / 1e6:.1f}M matmul parameters x 6 (train) / 2 "
        "(log-prob) FLOPs per useful token, attention FLOPs not included "
        "(JSON: mfu_with_attention)"
    )
    return "\n".join(lines)
