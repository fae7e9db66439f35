"""Memory per GPU of a launch, estimated from shapes alone (no GPU, no weights).

The trainer's terms (params, grads, optimizer, reference and served copies, activations,
scoring, runtime), vLLM's (weights, KV cache) and the colocated peak over the loop's
phases, each with its formula and source: docs/launch.md, "The memory model, term by term".
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megatron_grpo.config.schema import Config
from megatron_grpo.layouts import megatron as mg
from megatron_grpo.layouts import vllm as vl
from megatron_grpo.models.spec import ModelSpec, megatron_padded_vocab
from megatron_grpo.policy.micro_batches import micro_batch_token_budget
from megatron_grpo.policy.scoring import scoring_bytes

GIB = 1 << 30
RUNTIME_OVERHEAD_BYTES = int(1.5 * GIB)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def plan_dtype(cfg: Config) -> str:
    """The dtype a GPU run trains and serves in (``auto`` is bf16 on GPU)."""
    return "bfloat16" if cfg.model.dtype == "auto" else cfg.model.dtype


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def trainer_params_per_rank(spec: ModelSpec, cfg: Config) -> int:
    """Parameters of the largest (pp stage, tp rank) shard set, vocabulary padding included;
    an MoE rank holds ``num_experts / parallel.ep`` experts of every layer (every EP rank the
    same count, so EP rank 0 stands for all)."""
    p = cfg.parallel
    vpp = p.vpp or 1
    padded = megatron_padded_vocab(spec.vocab_size, p.tp, cfg.model.make_vocab_size_divisible_by)
    ml = mg.MegatronLayout(p.tp, p.pp, vpp, padded_vocab=padded, ep=p.ep)
    return max(
        sum(_numel(s.shape) for vp in range(vpp) for s in mg.chunk_shards(spec, ml, pp, vp, tp))
        for pp in range(p.pp)
        for tp in range(p.tp)
    )


def vllm_params_per_rank(spec: ModelSpec, rollout_tp: int, expert_parallel: bool = False) -> int:
    """The most parameters a vLLM rank holds (``expert_parallel``: whole local experts)."""
    return max(
        sum(_numel(s.shape) for s in vl.rank_shards(spec, rollout_tp, r, expert_parallel))
        for r in range(rollout_tp)
    )


def distributed_optimizer_on(cfg: Config) -> bool:
    return cfg.optim.distributed_optimizer in ("on", "auto")  # auto = on with CUDA


def unfused_attention(cfg: Config) -> bool:
    """Whether the trainer runs megatron's unfused ``DotProductAttention`` (the local spec with
    ``model.local_attention=unfused``; ``transformer_impl=auto`` is counted as local, the
    larger of the two)."""
    m = cfg.model
    return m.local_attention == "unfused" and m.transformer_impl != "transformer_engine"


def attention_score_bytes(spec: ModelSpec, cfg: Config, rows: int, recompute: bool) -> int:
    """Bytes of megatron's unfused attention scores for ``rows`` padded sequences of ``s``
    tokens per micro-batch (module docstring); 0 with SDPA or Transformer-Engine."""
    if not unfused_attention(cfg):
        return 0
    s = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    elem = DTYPE_BYTES[plan_dtype(cfg)]
    one = rows * (spec.num_heads // cfg.parallel.tp) * s * s  # [b, a/t, s, s] elements
    kept = (4 + (elem if elem < 4 else 0)) * one
    transient = (elem + 8) * one
    layers = 1 if recompute else spec.num_layers // cfg.parallel.pp
    return layers * kept + transient


def micro_batch_tokens(cfg: Config, budget: int | None = None) -> int:
    """Tokens one micro-batch holds at most (module docstring, ``n``): ``budget`` (packed),
    else the budget without a memory model (``policy.micro_batches.micro_batch_token_budget``)."""
    s = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    if not cfg.grpo.batch.pack_sequences:
        return s * cfg.grpo.batch.micro_batch_size
    packed = budget or micro_batch_token_budget(cfg)
    assert packed is not None, "pack_sequences: micro_batch_token_budget is an int"
    return max(packed, s)


def activation_bytes(
    spec: ModelSpec, cfg: Config, dp: int, recompute: bool, budget: int | None = None
) -> int:
    """Activation and scoring bytes of one training GPU (module docstring); ``budget``: the
    packed micro-batch's tokens (None: ``micro_batch_tokens(cfg)``)."""
    p, g = cfg.parallel, cfg.grpo
    s = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    n, h, t = micro_batch_tokens(cfg, budget), spec.hidden_size, p.tp
    elem = DTYPE_BYTES[plan_dtype(cfg)]
    scale = elem / 2  # the formula counts 16-bit activations
    # context parallelism: a rank holds n/cp of the pack's tokens, and each layer keeps the
    # K/V of all n it gathered (policy.context_parallel; docs/context-parallel.md)
    local = n / p.cp
    gathered_kv = n * 2 * max(1, spec.num_kv_heads // t) * spec.head_dim * elem if p.cp > 1 else 0
    full_layer = local * h * (34 / t if p.sequence_parallel else 10 + 24 / t) * scale
    full_layer += gathered_kv
    layers = spec.num_layers // p.pp
    if recompute:
        per_micro = layers * 2 * local * h * scale / (t if p.sequence_parallel else 1)
        per_micro += full_layer
    else:
        per_micro = layers * full_layer
    per_micro += attention_score_bytes(spec, cfg, g.batch.micro_batch_size, recompute)
    batch = g.batch.mini_batch_size or g.batch.prompts_per_step * g.group_size
    micro_batches = max(1, batch * s // max(dp, 1) // n)
    in_flight = min(p.pp, micro_batches)
    padded = megatron_padded_vocab(spec.vocab_size, t, cfg.model.make_vocab_size_divisible_by)
    scoring = scoring_bytes(cfg.model.logprob_impl, math.ceil(local), padded // t, h, elem)
    return int(per_micro * in_flight + scoring)


def kv_bytes_per_token(spec: ModelSpec, rollout_tp: int, elem: int) -> int:
    kv_heads = max(1, spec.num_kv_heads // rollout_tp)
    return spec.num_layers * 2 * kv_heads * spec.head_dim * elem


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU, by component, for one GPU role (``train``, ``rollout`` or both)."""

    role: str
    components: dict[str, int]
    total: int
    """The peak over the phases of a step (see the module docstring)."""

    phases: dict[str, int] = dataclasses.field(default_factory=dict)
    """Bytes held in each phase of a step (colocated: generate, train, sync, checkpoint);
    ``total`` is their maximum."""

    def to_dict(self) -> dict[str, int]:
        return {**self.components, "total": self.total}

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.__getitem__) if self.phases else self.role


@dataclass(frozen=True)
class MemoryReport:
    per_role: dict[str, MemoryEstimate]
    kv_cache_needed: int
    """KV cache one engine needs to hold all its sequences of a step at once."""
    kv_cache_reserved: int
    sequences_per_engine: int

    @property
    def peak(self) -> MemoryEstimate:
        return max(self.per_role.values(), key=lambda m: m.total)


def colocated_phases(trainer: dict[str, int], vllm_weights: int, reserved: int, r) -> dict:
    """Bytes per phase of the colocated loop (module docstring), runtime overhead included."""
    opt = trainer["grads"] + trainer["optimizer"]
    copies = trainer["reference"] + trainer["served"]
    full = trainer["params"] + opt + copies
    offloaded = {"none": 0, "optimizer": opt, "all": opt + trainer["params"]}[r.trainer_offload]
    sleep = r.sleep_between_rollouts
    awake_at_sync = vllm_weights if sleep else reserved
    phases = {
        "generate": full - offloaded + reserved,
        "train": full + trainer["activations"] + (0 if sleep else reserved),
        "sync": full - (opt if r.trainer_offload != "none" else 0) + awake_at_sync,
        "checkpoint": full + awake_at_sync,
    }
    return {k: v + RUNTIME_OVERHEAD_BYTES for k, v in phases.items()}


def estimate_memory(
    spec: ModelSpec,
    cfg: Config,
    *,
    dp: int,
    num_engines: int,
    colocated: bool,
    capacity_bytes: int,
    recompute: bool = False,
    budget: int | None = None,
) -> MemoryReport:
    """``recompute``: count activations with full recompute even where ``model.recompute``
    is ``none`` (``plan --recompute``: what would it take?). ``budget``: a packed
    micro-batch's tokens (``dry_run.budget``; None: ``micro_batch_tokens(cfg)``)."""
    elem = DTYPE_BYTES[plan_dtype(cfg)]
    n = trainer_params_per_rank(spec, cfg)
    opt_per_param = 8 + (4 if elem < 4 else 0)
    opt = n * opt_per_param
    if distributed_optimizer_on(cfg):  # megatron shards it over the dp x cp group
        opt //= dp * cfg.parallel.cp
    trainer = {
        "params": n * elem,
        "grads": n * 4,
        "optimizer": opt,
        "reference": n * elem if cfg.grpo.kl.kl_coef > 0 else 0,
        "served": n * elem if cfg.checkpoint.exact_resume and cfg.sync.can_lag else 0,
        "activations": activation_bytes(
            spec, cfg, dp, recompute or cfg.model.recompute == "full", budget
        ),
    }
    state = sum(v for k, v in trainer.items() if k != "activations")
    r = cfg.rollout
    weights = vllm_params_per_rank(spec, r.tp, r.expert_parallel) * elem
    reserved = int(r.gpu_memory_utilization * capacity_bytes)
    kv_reserved = max(0, reserved - weights)
    seqs = cfg.grpo.batch.prompts_per_step // max(num_engines, 1) * cfg.grpo.group_size
    kv_needed = seqs * r.max_model_len * kv_bytes_per_token(spec, r.tp, elem)
    vllm = {"vllm_weights": weights, "vllm_kv_cache": kv_reserved}
    rt = {"runtime": RUNTIME_OVERHEAD_BYTES}
    roles: dict[str, MemoryEstimate] = {}
    if colocated:
        phases = colocated_phases(trainer, weights, reserved, r)
        total = max(phases.values())
        roles["train+rollout"] = MemoryEstimate(
            "train+rollout", {**trainer, **vllm, **rt}, total, phases
        )
    else:
        t_total = RUNTIME_OVERHEAD_BYTES + state + trainer["activations"]
        zero_v = {k: 0 for k in vllm}
        roles["train"] = MemoryEstimate("train", {**trainer, **zero_v, **rt}, t_total)
        zero_t = {k: 0 for k in trainer}
        roles["rollout"] = MemoryEstimate(
            "rollout", {**zero_t, **vllm, **rt}, RUNTIME_OVERHEAD_BYTES + reserved
        )
    return MemoryReport(roles, kv_needed, kv_reserved, seqs)
