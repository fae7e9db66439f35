"""The one typed config tree of megatron-grpo.

Every default lives here and nowhere else: YAML files and ``key=value`` overrides only
change fields, and code reads fields (never ``cfg.get(key, default)``). Each section
validates itself in ``__post_init__``; checks that need several sections live in
``Config.__post_init__``. Errors are ``ConfigError`` and say what is wrong, why, and how
to fix it, naming the values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal


class ConfigError(ValueError):
    """A config value is invalid; the message names the key, the value and the fix."""


def _check_choice(key: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(
            f"{key}={value!r} is not one of {list(choices)}: set {key} to one of them."
        )


def _check_positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key}={value!r} must be {bound}.")


def _positive(section: str, cfg: object, *fields: str) -> None:
    """ConfigError naming ``section.field`` for the first of ``fields`` of ``cfg`` not > 0."""
    for name in fields:
        _check_positive(f"{section}.{name}", getattr(cfg, name))


def _non_negative(section: str, cfg: object, *fields: str) -> None:
    """ConfigError naming ``section.field`` for the first of ``fields`` of ``cfg`` below 0."""
    for name in fields:
        _check_positive(f"{section}.{name}", getattr(cfg, name), allow_zero=True)


@dataclass
class KernelsConfig:
    """Layer-level kernels of the local layer spec, chosen once at build
    (``policy/kernels.py``; docs/kernels.md). Transformer-Engine's spec, which brings its own
    fused norms and activations, is ``model.transformer_impl``."""

    packed_rope: bool = True
    """RoPE of a packed micro-batch from the pack's positions, cos/sin once per micro-batch,
    applied by the SDPA core attention (``policy/rope.py``). false: megatron's RoPE, one
    document at a time. Only where the core attention is the project's
    (``model.local_attention=sdpa`` on the local spec); elsewhere megatron's RoPE runs."""
    liger: Literal["auto", "on", "off"] = "auto"
    """Liger-Kernel's fused RMSNorm and SwiGLU (Triton, CUDA only; the ``gpu`` extra installs
    it) in place of the local spec's ``torch.nn.RMSNorm`` and megatron's unfused SwiGLU.
    ``auto``: on where liger-kernel is installed, the device is CUDA, the spec is local and
    ``compile`` is off."""
    compile: Literal["off", "on"] = "off"
    """``on``: ``torch.compile`` of the local spec's RMSNorm and SwiGLU (each one fused
    elementwise region); cannot be combined with ``liger=on``."""

    def __post_init__(self) -> None:
        for key in ("liger", "compile"):  # YAML 1.1 reads a bare on/off as a boolean
            if isinstance(getattr(self, key), bool):
                setattr(self, key, "on" if getattr(self, key) else "off")
        _check_choice("model.kernels.liger", self.liger, ("auto", "on", "off"))
        _check_choice("model.kernels.compile", self.compile, ("off", "on"))
        if self.liger == "on" and self.compile == "on":
            raise ConfigError(
                "model.kernels.liger=on and model.kernels.compile=on both replace the local "
                "spec's RMSNorm and SwiGLU: set one of them to off."
            )


@dataclass
class ModelConfig:
    hf_path: str = "tiny"
    """Hugging Face model directory (config.json, *.safetensors, tokenizer files), or a preset
    name (``tiny``, ``Qwen2.5-0.5B``, ``Qwen2.5-1.5B``, ``Qwen2.5-7B``) that builds random
    weights of that shape in the run directory."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Training parameter dtype. ``auto``: float32 on CPU, bfloat16 on GPU."""
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    """Megatron layer spec. ``auto``: Transformer-Engine when installed and on GPU, else local."""
    local_attention: Literal["sdpa", "unfused"] = "sdpa"
    """Core attention of the local layer spec (ignored by the Transformer-Engine spec).
    ``sdpa``: torch's ``scaled_dot_product_attention`` (flash / cuDNN / memory-efficient on
    GPU; no [heads, s, s] scores held; packed sequences supported;
    ``policy.attention.SDPAttention``); ``unfused``: megatron's ``DotProductAttention``, which
    materializes the fp32 scores of every layer and cannot pack sequences (the parity
    reference)."""
    recompute: Literal["none", "full"] = "none"
    """Activation recomputation. ``full``: every layer is recomputed in the backward pass
    from its saved input (the local spec: torch's non-reentrant checkpoint per layer, which
    stops before the layer's fc2, ``policy.model_builder.checkpoint_layers``; TE layers:
    megatron's ``recompute_granularity=full``, ``uniform``, one layer per group), keeping
    ~``2*tokens*hidden`` bytes per layer instead of the layer's whole activations: about 1/3
    more compute for the longest sequences (``megatron-grpo plan`` counts either; its
    ``--recompute`` flag asks the same question of a config)."""
    logprob_impl: Literal["auto", "fused", "logits"] = "auto"
    """How the last pipeline stage turns hidden states into per-token log-probs and entropies
    (``policy/scoring.py``). ``fused``: the output layer's matmul, log-softmax and entropy in
    one chunked autograd Function that never holds the [tokens, vocab/tp] logits (backward
    recomputes each chunk's logits; needs megatron-core's ``GPTModel.forward(output_processor)``,
    0.19.2); ``logits``: the output layer's logits, then the chunked vocab-parallel log-prob
    (~3 copies of the logits per micro-batch); ``auto``: fused where megatron-core has the
    hook, else logits. Both agree to fp32 rounding (docs/scoring.md)."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary to a multiple of this times the tensor-parallel size."""
    warm_start_steps: int = 15
    """Supervised steps on the prompt source's gold answers before GRPO, applied to a preset
    model built from random weights (the demo's warm start: a random model never samples
    a right answer, so GRPO alone would see no reward signal). 0 disables."""
    warm_start_lr: float = 3e-3
    warm_start_batch_size: int = 64
    moe_aux_loss_coeff: float = 0.0
    """MoE models: weight of megatron's load-balancing auxiliary loss (``aux_loss``, added to
    the policy loss's gradient by the router). 0 (the default) trains on the policy loss
    alone, as HF computes it without ``output_router_logits``; docs/moe.md."""
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    """Layer-level kernels: packed RoPE, Liger-Kernel, ``torch.compile`` (docs/kernels.md)."""

    def __post_init__(self) -> None:
        _check_choice("model.dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        _check_choice(
            "model.transformer_impl", self.transformer_impl, ("auto", "local", "transformer_engine")
        )
        _check_choice("model.local_attention", self.local_attention, ("sdpa", "unfused"))
        _check_choice("model.recompute", self.recompute, ("none", "full"))
        _check_choice("model.logprob_impl", self.logprob_impl, ("auto", "fused", "logits"))
        _positive("model", self, "make_vocab_size_divisible_by")
        _non_negative("model", self, "warm_start_steps")
        _positive("model", self, "warm_start_lr", "warm_start_batch_size")
        _non_negative("model", self, "moe_aux_loss_coeff")


@dataclass
class ParallelConfig:
    tp: int = 1
    """Trainer tensor-parallel size."""
    pp: int = 1
    """Trainer pipeline-parallel size."""
    dp: int = 0
    """Trainer data-parallel size; 0 derives it as WORLD_SIZE / (tp * pp * cp)."""
    vpp: int | None = None
    """Virtual pipeline stages per pipeline rank (interleaved schedule, GPU); None disables."""
    ep: int = 1
    """Expert-parallel size (MoE models): each EP rank holds num_experts/ep of every layer's
    experts; EP ranks are carved from the data-parallel ranks, so ep must divide dp.
    A dense model needs 1. docs/moe.md."""
    cp: int = 1
    """Context-parallel size: each packed micro-batch's tokens split over ``cp`` ranks (the
    zigzag share of every document), attention over the whole document through an
    all-gather of K/V per layer (padded rows are packed: ``policy.forward``); needs the SDPA
    attention and packed RoPE, and (for now) no vpp. Runs with TP (with and without
    sequence parallelism), PP, EP and DP. docs/context-parallel.md."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (requires tp > 1): the norms and residuals of each layer
    hold 1/tp of the tokens, gathered and scattered around attention and the MLP (the
    activations outside them shrink by tp; needed by MoE layers at tp > 1). Runs on CPU and
    GPU, with TE's layers or the local spec (``policy.model_builder.LocalRMSNorm``). Micro-
    batches are padded to a multiple of tp tokens (``policy/micro_batches.py``), a pack's
    share of each CP rank too."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend. ``auto``: nccl when CUDA is present, else gloo."""
    timeout_s: float = 600.0
    """Timeout of every collective and of every phase of the training loop (the watchdog,
    trainer/watchdog.py), after which the rank fails with an error instead of hanging; what a
    hung peer rank costs (docs/launch.md "Restarts"). Keep it above the longest phase."""
    heartbeat_timeout_s: float = 10.0
    """Disaggregated placement: a peer of the control channel (rollout/control.py; beats every
    2 s) that has been heard from and then stays silent this long is dead, and the waiting
    side stops (torchrun then restarts the job: docs/launch.md "Restarts"), instead of after
    ``timeout_s``. A peer not heard from yet (starting) still gets ``timeout_s``."""

    def __post_init__(self) -> None:
        _positive("parallel", self, "tp", "pp", "ep", "cp")
        _non_negative("parallel", self, "dp")
        if self.vpp is not None:
            _positive("parallel", self, "vpp")
            if self.pp < 2:
                raise ConfigError(
                    f"parallel.vpp={self.vpp} needs parallel.pp >= 2 (got {self.pp}): "
                    "set parallel.vpp=null or raise parallel.pp."
                )
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError(
                "parallel.sequence_parallel=true needs parallel.tp > 1 (got 1): "
                "set parallel.sequence_parallel=false or raise parallel.tp."
            )
        _check_choice("parallel.backend", self.backend, ("auto", "gloo", "nccl"))
        _positive("parallel", self, "timeout_s", "heartbeat_timeout_s")


@dataclass
class RolloutConfig:
    placement: Literal["colocated", "disaggregated"] = "colocated"
    """``colocated``: each trainer rank hosts its vLLM rank in-process (external_launcher).
    ``disaggregated``: vLLM engines run on their own ranks/devices, fed over the network."""
    tp: int = 1
    """vLLM tensor-parallel size."""
    num_engines: int = 0
    """Disaggregated only: number of vLLM engines (0 = one per rollout group). Colocated
    placement derives the engine count from the world size."""
    max_new_tokens: int = 16
    """Maximum response length in tokens."""
    temperature: float = 1.0
    """Sampling temperature T (> 0). The trainer's log-probs (ratio, exact-mode r', KL) are
    computed from logits / T and vLLM returns processed log-probs, so both score the
    distribution sampled from (docs/algorithms.md, "Temperature")."""
    top_p: float = 1.0
    """Must stay 1: the importance ratio does not model top-p truncation."""
    top_k: int = -1
    """Must stay -1 (or 0): the importance ratio does not model top-k truncation."""
    max_model_len: int = 256
    """vLLM context length (prompt + response)."""
    gpu_memory_utilization: float = 0.3
    """GPU only: fraction of device memory vLLM may take (weights + KV cache)."""
    cpu_kv_cache_gb: float = 1.0
    """CPU only: KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE)."""
    enforce_eager: bool = True
    sleep_between_rollouts: bool = True
    """GPU colocated only: vLLM sleeps after each generation and wakes (weights before the
    weight sync, KV cache before the next generation) so the trainer has the GPU while it
    trains (trainer/colocated_memory.py). false: vLLM's reservation stays while the trainer trains."""
    sleep_level: int = 1
    """vLLM sleep level: 1 offloads its weights to CPU memory and drops the KV cache; 2 drops
    the weights too (less CPU memory; every step's weight sync refills them, so it needs
    sync.interval=1)."""
    trainer_offload: Literal["none", "optimizer", "all"] = "optimizer"
    """GPU colocated only: what the trainer moves to CPU while vLLM generates. ``optimizer``:
    Adam state, fp32 master weights and gradient buffers (back before the log-probs, off
    again before the weight sync); ``all``: also the weights (off after the sync);
    ``none``: everything stays on the GPU."""
    seed: int = 0
    ahead: int = 0
    """How many future steps' batches of the current sync window may be generated before the
    trainer asks for them (rollout/ahead.py). 0: today's serial schedule (generate step k,
    train step k, generate step k+1, ...). a > 0: when step k needs its batch and none is
    buffered, steps k..min(k+a, next sync step, steps) are generated together (colocated: one
    vLLM call; disaggregated: queued back to back on the engines, streamed to the trainer).
    Never past the next sync, so every batch comes from the weights Algorithm 1 prescribes
    (same policy_version and lag); values above sync.interval-1 act as sync.interval-1.
    With sync.mode=adaptive the next sync is not known in advance: a window reaches at most
    sync.min_interval steps past the last sync (no sync can come sooner), and past that the
    steps are generated one at a time, after the decision of the step before."""
    routing_replay: Literal["off", "measure", "on"] = "off"
    """MoE models only (docs/moe.md, "Routing replay"). ``on``: vLLM returns the experts it
    routed every token to, the samples carry them, and the trainer's log-prob passes and
    train steps route each token to those experts (the router's own probabilities at
    them); ``measure``: the same capture, the trainer routes by itself, and each step logs
    ``routing_mismatch``, the share of (token, MoE layer) routings where the trainer's
    router chose other experts than vLLM (also logged with ``on``: the router's own choice
    against vLLM's); ``off``: no capture."""
    expert_parallel: bool = False
    """MoE models on GPU only (docs/moe.md, "vLLM expert parallelism"): vLLM runs
    ``enable_expert_parallel`` (its EP size = rollout.tp), so each vLLM rank holds whole
    experts, only its own, and the weight sync sends each one straight from the trainer rank
    holding it to the vLLM rank that serves it. Needs rollout.tp > 1."""

    def __post_init__(self) -> None:
        if self.expert_parallel not in (True, False):
            raise ConfigError(
                f"rollout.expert_parallel={self.expert_parallel!r} must be true or false."
            )
        if self.expert_parallel and self.tp == 1:
            raise ConfigError(
                "rollout.expert_parallel=true with rollout.tp=1: vLLM's expert-parallel size is "
                "its TP size, so one rank would hold every expert; set rollout.tp > 1 or "
                "rollout.expert_parallel=false."
            )
        if isinstance(self.routing_replay, bool):  # YAML 1.1 reads on/off as booleans
            self.routing_replay = "on" if self.routing_replay else "off"
        _check_choice("rollout.routing_replay", self.routing_replay, ("off", "measure", "on"))
        _check_choice("rollout.placement", self.placement, ("colocated", "disaggregated"))
        _positive("rollout", self, "tp")
        _non_negative("rollout", self, "num_engines")
        _positive("rollout", self, "max_new_tokens")
        if self.temperature <= 0:
            raise ConfigError(
                f"rollout.temperature={self.temperature} must be > 0: greedy sampling gives G "
                "equal responses (no group signal); `megatron-grpo eval --greedy` samples at "
                "T=0 by itself."
            )
        if self.top_p != 1 or self.top_k not in (-1, 0):
            raise ConfigError(
                f"rollout.top_p={self.top_p}, rollout.top_k={self.top_k}: truncated sampling is "
                "refused because the trainer's ratio and KL use the untruncated softmax(logits/T) "
                "(no top-k/top-p mask on the trainer); set rollout.top_p=1 rollout.top_k=-1."
            )
        _positive("rollout", self, "max_model_len")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"rollout.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]."
            )
        _check_choice("rollout.sleep_level", self.sleep_level, (1, 2))
        _check_choice("rollout.trainer_offload", self.trainer_offload, ("none", "optimizer", "all"))
        if isinstance(self.ahead, bool) or not isinstance(self.ahead, int) or self.ahead < 0:
            raise ConfigError(
                f"rollout.ahead={self.ahead!r} must be an integer >= 0 (0 = serial; a = steps "
                "of the sync window generated ahead of the trainer, e.g. rollout.ahead=3)."
            )


POLICY_LOSSES = ("off_policy_clip", "rec", "gspo")
"""The built-in ``grpo.loss.policy_loss`` names (algorithms/policy_loss.py ``SURROGATES``)."""


@dataclass
class BatchConfig:
    """``grpo.batch``: how many samples a step takes and how they are cut for the passes."""

    prompts_per_step: int = 8
    """Prompts sampled per trainer step (the batch is prompts_per_step * group_size)."""
    sgd_iterations: int = 1
    """i: SGD passes over each batch (paper's Algorithm 1)."""
    mini_batch_size: int = 0
    """Sequences per optimizer step within one SGD pass; 0 = the whole batch."""
    micro_batch_size: int = 64
    """Sequences per forward/backward micro-batch when ``pack_sequences=false``; with packing
    it only sets ``micro_batch_tokens=0``'s budget (and ``auto``'s on CPU)."""
    pack_sequences: bool = True
    """Pack each micro-batch's sequences end to end under a token budget
    (``micro_batch_tokens``) for the train step and the log-prob passes: no compute on padding,
    and as many short sequences per micro-batch as the budget holds (``policy.policy``
    ``PackedRows``). ``false``: ``micro_batch_size`` rows, each micro-batch padded to its
    longest (megatron's unfused attention, ``model.local_attention=unfused``, needs this)."""
    micro_batch_tokens: int | Literal["auto"] = "auto"
    """Real tokens per packed micro-batch, at least one whole sequence (``data.max_prompt_tokens
    + rollout.max_new_tokens``: a sequence never splits). ``auto``: on a GPU, the most that
    fits the device's memory after the weights, gradients and optimizer state (the memory
    model of ``megatron-grpo plan``, which prints it and what bounds it; a multiple of 256
    tokens, at most one step's sequences per rank; ``dry_run/budget.py``); on CPU, the 0
    below. 0 = ``micro_batch_size * (data.max_prompt_tokens + rollout.max_new_tokens)``."""

    def __post_init__(self) -> None:
        _positive("grpo.batch", self, "prompts_per_step", "sgd_iterations")
        _non_negative("grpo.batch", self, "mini_batch_size")
        _positive("grpo.batch", self, "micro_batch_size")
        t = self.micro_batch_tokens
        if t != "auto" and (isinstance(t, (bool, str)) or t < 0):
            raise ConfigError(
                f"grpo.batch.micro_batch_tokens={t!r} must be 'auto' (sized by the GPU's memory) "
                "or an integer >= 0 (0: grpo.batch.micro_batch_size full-length sequences)."
            )


@dataclass
class LossConfig:
    """``grpo.loss``: the policy loss, its clips and regularizers, and how it is aggregated."""

    policy_loss: str = "off_policy_clip"
    """``off_policy_clip``: f_eps(r, r', A) (PPO/DAPO/dual-clip family); ``rec``: group-relative
    REINFORCE with clip masks and weights (Yao et al.); ``gspo``: sequence-level ratio; or a
    loss class of your own, ``path/to/file.py:Name`` or ``package.module:Name``, built as
    ``Name(grpo)`` (docs/algorithms.md, "Write your own loss")."""
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float | None = None
    """Dual-clip bound c (> 1) for negative advantages; None disables."""
    rec_clip: Literal["none", "one_side", "two_side", "ring"] = "one_side"
    rec_weight: Literal["none", "is", "tis"] = "none"
    rec_ring_eps_low: float = 0.6
    """eps'_low of the REC paper: the outer ring of ``rec_clip=ring`` (``rho <= 1-eps'_low``)
    and the lower clamp of ``rec_weight=tis`` (``clamp(rho, 1-eps'_low, 1+eps'_high)``)."""
    rec_ring_eps_high: float = 2.0
    """eps'_high of the REC paper (ring: ``rho >= 1+eps'_high``; TIS: the upper clamp)."""
    regularizer: Literal["none", "asymre", "opmd"] = "none"
    regularizer_coef: float = 0.0
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant"] = (
        "token_mean"
    )
    loss_agg_constant: float = 0.0
    """Normalizer for loss_agg=constant (Dr.GRPO); 0 = rollout.max_new_tokens."""
    loss_normalizer: Literal["kept", "all"] = "kept"
    """Which samples the loss's token/sequence counts run over: ``kept`` (after the
    zero-variance mask and RED-Drop; DAPO's per-batch renormalisation) or ``all`` (every
    sampled response; the off-policy GRPO paper's expectation over all prompts)."""
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        if ":" not in self.policy_loss and self.policy_loss not in POLICY_LOSSES:
            raise ConfigError(  # a class path is loaded (and checked) by make_loss_fn
                f"grpo.loss.policy_loss={self.policy_loss!r} is not one of {list(POLICY_LOSSES)}: "
                "set grpo.loss.policy_loss to one of them, or to a loss class "
                "'path/to/file.py:Name' (docs/algorithms.md, 'Write your own loss')."
            )
        _check_choice("grpo.loss.rec_clip", self.rec_clip, ("none", "one_side", "two_side", "ring"))
        _check_choice("grpo.loss.rec_weight", self.rec_weight, ("none", "is", "tis"))
        _check_choice("grpo.loss.regularizer", self.regularizer, ("none", "asymre", "opmd"))
        _check_choice(
            "grpo.loss.loss_agg",
            self.loss_agg,
            ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant"),
        )
        _check_choice("grpo.loss.loss_normalizer", self.loss_normalizer, ("kept", "all"))
        if self.policy_loss == "gspo" and self.loss_agg != "seq_mean_token_mean":
            raise ConfigError(
                f"grpo.loss.policy_loss=gspo with grpo.loss.loss_agg={self.loss_agg!r}: GSPO's "
                "objective is a mean over sequences of the sequence ratio; set "
                "grpo.loss.loss_agg=seq_mean_token_mean."
            )
        _non_negative("grpo.loss", self, "clip_eps_low", "clip_eps_high")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            raise ConfigError(
                f"grpo.loss.dual_clip_c={self.dual_clip_c} must be > 1 (3 is usual) or null to "
                "disable."
            )


@dataclass
class KLConfig:
    """``grpo.kl``: the reference policy pi_ref and the KL penalty towards it."""

    kl_coef: float = 0.0
    """beta: KL(pi || pi_ref) coefficient; 0 disables the reference policy."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_in_reward: bool = False
    """Subtract beta*KL from the reward instead of adding it to the loss."""
    ref_update_interval: int = 0
    """Reset pi_ref <- pi_theta every this many steps (0 = never)."""

    def __post_init__(self) -> None:
        _check_choice("grpo.kl.kl_estimator", self.kl_estimator, ("k1", "k2", "k3"))
        _non_negative("grpo.kl", self, "kl_coef", "ref_update_interval")


@dataclass
class OffPolicyConfig:
    """``grpo.off_policy``: the corrections for samples drawn by an older policy alpha."""

    ratio_mode: Literal["one", "exact"] = "one"
    """r' = pi_k/alpha: ``one`` approximates r' = 1 (paper's runs); ``exact`` recomputes pi_k's
    log-probs on the trainer and keeps alpha's from the rollout."""
    tis: Literal["none", "token_truncate", "token_mask", "seq_truncate", "seq_mask"] = "none"
    """Rollout-mismatch TIS, ``min(exp(logp_old - logp_rollout), tis_cap)`` (needs
    ratio_mode=exact, or score_alpha); unrelated to REC's ``rec_weight=tis``. With
    ``score_alpha`` it truncates (masks) the numerics ratio alpha_trainer/alpha_vLLM only."""
    tis_cap: float = 2.0
    score_alpha: bool = False
    """Score each batch's samples on the trainer under the weights that generated them
    (alpha), to split today's ratio pi_k/alpha_vLLM into staleness (pi_k/alpha_trainer) and
    engine numerics (alpha_trainer/alpha_vLLM): the off-policy clip, REC/GSPO and OPMD read
    the staleness ratio, ``tis`` the numerics one, ``sync.mode=adaptive`` the staleness KL,
    and each step logs both (docs/algorithms.md, "Staleness and numerics"). Cost: one
    log-prob pass per batch at lag > 0 (none at lag 0, where the trainer holds alpha), by
    a forward-only copy of the served weights: ``checkpoint.exact_resume``'s (the default)
    when it keeps one, else one more copy of the weights, refreshed at each sync."""

    def __post_init__(self) -> None:
        _check_choice("grpo.off_policy.ratio_mode", self.ratio_mode, ("one", "exact"))
        _check_choice(
            "grpo.off_policy.tis",
            self.tis,
            ("none", "token_truncate", "token_mask", "seq_truncate", "seq_mask"),
        )
        if self.tis != "none" and self.ratio_mode != "exact" and not self.score_alpha:
            raise ConfigError(
                f"grpo.off_policy.tis={self.tis!r} compares the trainer's log-probs of alpha with "
                "the rollout's, which only grpo.off_policy.ratio_mode=exact or "
                "grpo.off_policy.score_alpha=true computes: set grpo.off_policy.ratio_mode=exact, "
                "grpo.off_policy.score_alpha=true or grpo.off_policy.tis=none."
            )


@dataclass
class DynamicSamplingConfig:
    """``grpo.dynamic_sampling``: DAPO's dynamic sampling (docs/algorithms.md, "Dynamic
    sampling"). A group whose G rewards are all equal carries no advantage; with this on,
    each step generates more prompts than it trains on, keeps the groups whose rewards
    differ and fills the batch with exactly ``grpo.batch.prompts_per_step`` of them."""

    enabled: bool = False
    """Off by default: every generated group is trained on (zero-variance groups masked)."""
    oversample: float = 1.5
    """Prompts generated per round, as a multiple of ``grpo.batch.prompts_per_step``
    (rounded up): the first round generates them with the step, and each further round as
    many again while the batch is not full."""
    max_rounds: int = 3
    """Rounds of generation per step, the first included. When they are spent and fewer
    than ``prompts_per_step`` groups differ, the batch is made up with zero-variance groups
    (which the mask leaves without gradient) and the step says how many it filled."""

    def __post_init__(self) -> None:
        if not self.oversample >= 1.0:
            raise ConfigError(
                f"grpo.dynamic_sampling.oversample={self.oversample} must be >= 1: it is how "
                "many prompts a round generates per prompt the step trains on (e.g. 1.5)."
            )
        if isinstance(self.max_rounds, bool) or self.max_rounds < 1:
            raise ConfigError(
                f"grpo.dynamic_sampling.max_rounds={self.max_rounds} must be an integer >= 1 "
                "(rounds of generation per step, the first included; e.g. 3)."
            )


@dataclass
class GRPOConfig:
    """The algorithm: the group advantages here, the rest in five sections (``batch``,
    ``loss``, ``kl``, ``off_policy``, ``dynamic_sampling``)."""

    group_size: int = 8
    """G: responses sampled per prompt."""
    advantage: Literal["grpo", "drgrpo", "red_weight"] = "grpo"
    """``grpo``: (r - mean)/sqrt(std^2 + eps); ``drgrpo``: r - mean; ``red_weight``:
    A * exp(A / tau) on unnormalized advantages."""
    advantage_eps: float = 1e-6
    red_weight_tau: float = 1.0
    red_drop: bool = False
    """RED-Drop: drop surplus negatives in groups with more negatives than positives."""
    zero_variance_mask: bool = True
    """Groups whose G rewards are all equal contribute nothing (paper eq. 8 mask)."""
    overlong_buffer: int = 0
    """DAPO overlong shaping: linear penalty over the last this-many tokens; 0 disables."""
    overlong_penalty: float = 1.0
    """DAPO overlong shaping: the penalty a response of the full length gets."""
    overlong_filter: bool = False
    """DAPO overlong filtering: truncated responses get no gradient."""
    batch: BatchConfig = field(default_factory=BatchConfig)
    """Batching: prompts per step, SGD passes, mini- and micro-batches, packing."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The policy loss, its clips, regularizers and aggregation."""
    kl: KLConfig = field(default_factory=KLConfig)
    """The reference policy and the KL penalty."""
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    """Off-policy corrections: pi_k/alpha, TIS, scoring alpha on the trainer."""
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    """DAPO's dynamic sampling: train only on groups whose rewards differ."""

    def __post_init__(self) -> None:
        _positive("grpo", self, "group_size")
        if self.group_size < 2:
            raise ConfigError(
                f"grpo.group_size={self.group_size}: group advantages need at least 2 "
                "responses per prompt; set grpo.group_size >= 2."
            )
        _check_choice("grpo.advantage", self.advantage, ("grpo", "drgrpo", "red_weight"))
        _non_negative("grpo", self, "overlong_buffer")


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate. The default suits the tiny demo model; LLM configs set their own
    (the paper: 5e-6 for Qwen2.5-0.5B, 1e-6 for R1-Distill-1.5B)."""
    min_lr: float = 0.0
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    distributed_optimizer: Literal["auto", "on", "off"] = "auto"
    """Megatron's distributed (ZeRO-1) optimizer. ``auto``: on with CUDA, off on CPU."""
    fused_adam: Literal["auto", "on", "off"] = "auto"
    """torch's fused AdamW (``fused=True``: one kernel over all the optimizer's fp32 main
    params) in megatron's optimizer, plain or distributed, where megatron runs torch's AdamW
    (no Transformer-Engine or Apex; theirs is fused already). ``auto``: on with CUDA, off on
    CPU; ``off``: torch's default (foreach on CUDA, a per-parameter loop on CPU). Fused and
    unfused steps differ in rounding only (docs/architecture-policy.md, "The optimizer")."""
    max_nan_steps_in_row: int = 3
    """Skip a step whose loss or grad norm is not finite; abort after this many in a row."""

    def __post_init__(self) -> None:
        _positive("optim", self, "lr")
        _non_negative("optim", self, "min_lr")
        if self.min_lr > self.lr:
            raise ConfigError(f"optim.min_lr={self.min_lr} exceeds optim.lr={self.lr}.")
        _check_choice("optim.lr_schedule", self.lr_schedule, ("constant", "cosine"))
        _non_negative("optim", self, "warmup_steps", "clip_grad")
        for key in ("distributed_optimizer", "fused_adam"):
            if isinstance(getattr(self, key), bool):
                # YAML 1.1 reads a bare on/off (optim.fused_adam=on) as a boolean.
                setattr(self, key, "on" if getattr(self, key) else "off")
            _check_choice(f"optim.{key}", getattr(self, key), ("auto", "on", "off"))
        _positive("optim", self, "max_nan_steps_in_row")


@dataclass
class SyncConfig:
    mode: Literal["fixed", "adaptive"] = "fixed"
    """``fixed``: sync every ``interval`` steps (Algorithm 1). ``adaptive``: sync after a step
    once ``min_interval`` steps have trained on the served weights and the step's measured
    drift of the trainer's policy from the served one exceeds ``max_drift``, or once
    ``max_interval`` steps have (``interval`` is then unused). The drift is the token-mean k3
    estimate of KL(alpha || pi_k) on the step's samples (algorithms/drift.py;
    docs/algorithms.md, "Adaptive sync"); with ``grpo.off_policy.ratio_mode=one`` it costs one extra
    forward pass of the batch per step (``exact`` has pi_k's log-probs already). With
    ``grpo.off_policy.score_alpha`` alpha is scored by the trainer: the drift is the staleness
    alone, without vLLM's numerical mismatch with the trainer."""
    interval: int = 4
    """v: push the trainer's weights to vLLM when step % v == 0 (Algorithm 1); ``mode=fixed``."""
    max_drift: float = 0.01
    """``mode=adaptive``: sync when the step's drift (per-token KL(alpha || pi_k), nats)
    exceeds this. By Pinsker, a sequence of L tokens then has TV(pi_k, alpha) <= sqrt(L *
    max_drift / 2), the distance the paper's bound charges (roughly: the drift is a batch
    mean, measured before the step's update, which may overshoot it). The run's ``drift`` column
    (metrics.jsonl; logged in fixed mode too with ``grpo.off_policy.ratio_mode=exact``) shows the
    scale of a job."""
    min_interval: int = 1
    """``mode=adaptive``: never sync before this many steps trained on the served weights;
    ``rollout.ahead`` generates at most this many steps of a window at once."""
    max_interval: int = 16
    """``mode=adaptive``: always sync once this many steps trained on the served weights."""
    method: Literal["direct", "baseline"] = "direct"
    """``direct``: the resharding bridge (each vLLM rank gets exactly its shard);
    ``baseline``: gather full HF tensors and feed vLLM's load_weights (what anchors do)."""
    bucket_mb: float = 64.0
    """Size of the flat packed buckets the bridge sends."""
    verify: bool = False
    """After each sync, check vLLM's checksums against what was sent."""
    timeout_s: float = 120.0
    """Every wait of a sync ends in an error naming the peer after this long."""

    def __post_init__(self) -> None:
        _check_choice("sync.mode", self.mode, ("fixed", "adaptive"))
        _positive("sync", self, "interval", "max_drift", "min_interval", "max_interval")
        if self.min_interval > self.max_interval:
            raise ConfigError(
                f"sync.min_interval={self.min_interval} exceeds sync.max_interval="
                f"{self.max_interval}: the adaptive schedule syncs between them; raise "
                "sync.max_interval or lower sync.min_interval."
            )
        _check_choice("sync.method", self.method, ("direct", "baseline"))
        _positive("sync", self, "bucket_mb", "timeout_s")

    @property
    def can_lag(self) -> bool:
        """True when vLLM may serve weights older than the trainer's (a window of more than
        one step): fixed interval > 1, or adaptive max_interval > 1."""
        return (self.interval if self.mode == "fixed" else self.max_interval) > 1


@dataclass
class DataConfig:
    source: str = "synthetic:max"
    """``synthetic:<task>`` for a generated task, a local file (.jsonl, .parquet, .arrow), or a
    Hugging Face hub dataset name (online machines only)."""
    split: str = "train"
    prompt_key: str = "question"
    answer_key: str = "answer"
    template: str = "{prompt}"
    """Python format string applied to the prompt; ``chat`` uses the tokenizer's chat template."""
    shuffle_seed: int = 0
    strict: bool = False
    """Fail on the first malformed row instead of skipping and counting it."""
    synthetic_size: int = 4096
    synthetic_difficulty: int = 1
    """Difficulty knob of the synthetic task (e.g. number of digits)."""
    max_prompt_tokens: int = 64

    def __post_init__(self) -> None:
        if not self.source:
            raise ConfigError("data.source is empty: set it to synthetic:<task> or a data file.")
        _positive("data", self, "synthetic_size", "synthetic_difficulty", "max_prompt_tokens")


@dataclass
class RewardConfig:
    name: str = "synthetic"
    """``gsm8k``, ``gsm8k_flexible``, ``math`` (math-verify), ``synthetic``, a dotted path
    ``package.module:function`` taking (prompt, response, answer) and returning a float, or
    a reward server's URL ``http://HOST:PORT/PATH`` / ``https://...`` (docs/rewards-and-data.md,
    "Remote rewards")."""
    format_weight: float = 0.0
    """Weight of the format reward added to the task reward."""
    timeout_s: float = 5.0
    """Time limit of one reward call (of one HTTP request for a remote reward); a call past
    it scores 0."""
    num_workers: int = 2
    """Worker processes that run ``math`` and user rewards under the time limit (a worker
    whose call overruns is killed and replaced)."""
    concurrency: int = 64
    """Remote reward: HTTP requests in flight at once."""
    batch_size: int = 8
    """Remote reward: items per HTTP request (a step's 512 responses make 64 requests)."""
    retries: int = 3
    """Remote reward: how many times a request is sent again after a connection error or a
    5xx or 429 answer, before its items score 0 and count as errors."""
    backoff_s: float = 0.5
    """Remote reward: the wait before the first retry of a request, doubled before each
    next one."""
    judge_template: str = (
        "Question: {prompt}\nReference answer: {answer}\nResponse: {response}\n"
        "Is the response correct? Answer yes or no.\nAnswer:"
    )
    """``reward.name=judge:HF_DIR``: the judge's prompt; ``{prompt}``, ``{response}``,
    ``{answer}`` and any other key of the data row are filled in (docs/rewards-and-data.md,
    "A judge model as the reward")."""
    judge_choices: list[str] = field(default_factory=lambda: [" yes", " no"])
    """Judge: the verdicts whose log-probs after the prompt decide the reward (when
    ``judge_pattern`` is empty): the reward is ``sum_c softmax(logp)_c * judge_values[c]``."""
    judge_values: list[float] = field(default_factory=lambda: [1.0, 0.0])
    """Judge: the reward of each of ``judge_choices``."""
    judge_pattern: str = ""
    """Judge: a regex whose first group, in the judge's greedy answer, is the reward (a
    number); empty: decide by ``judge_choices``. A verdict without a match scores 0."""
    judge_max_tokens: int = 32
    """Judge with ``judge_pattern``: the longest verdict it generates, in tokens."""
    judge_max_model_len: int = 2048
    """Judge: its engine's context; a longer prompt keeps its end (the question to the judge)."""
    judge_gpu_memory_utilization: float = 0.15
    """Judge on a GPU: the share of the device's memory its engine takes, beside the rollout
    engine and the trainer of the process that scores."""
    judge_timeout_s: float = 300.0
    """Judge: the time limit of one request to it (in place of ``timeout_s``): its engine
    scores a step's requests together, so an answer can take a step's judging."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError(
                "reward.name is empty: set it to gsm8k, math, synthetic, a:path or a URL."
            )
        _positive("reward", self, "timeout_s", "num_workers", "concurrency", "batch_size")
        _positive("reward", self, "judge_max_tokens", "judge_max_model_len", "judge_timeout_s")
        if not 0 < self.judge_gpu_memory_utilization < 1:
            raise ConfigError(
                f"reward.judge_gpu_memory_utilization={self.judge_gpu_memory_utilization} must "
                "be in (0, 1): the share of the GPU's memory the judge's engine takes."
            )
        _non_negative("reward", self, "format_weight", "retries", "backoff_s")


@dataclass
class EnvConfig:
    """Multi-turn episodes: the model acts, an environment answers (docs/environments.md)."""

    name: str = ""
    """``path/to/file.py:ClassName`` or ``package.module:ClassName`` (built-in:
    ``megatron_grpo.environments.calculator:Calculator``); ``ClassName(row)`` once per episode,
    ``step(text) -> (reply, reward)`` per model turn. Empty: one response per sample, as
    before (bit for bit)."""
    max_turns: int = 4
    """Model turns per episode at most (the response token budget,
    ``rollout.max_new_tokens``, covers model and environment tokens together)."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a model turn besides EOS (e.g. ``</calc>``); the turn's text handed to
    ``step`` includes the one that ended it."""
    max_turn_tokens: int = 0
    """Tokens of one model turn at most (0: only the response budget bounds it); a turn cut
    there goes to ``step`` like any other."""
    timeout_s: float = 10.0
    """Time limit of one ``ClassName(row)`` or ``step`` call; past it the episode ends with
    reward 0 and is counted (``env_timeouts``)."""
    num_workers: int = 4
    """Threads that run environment calls side by side (per engine)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(x, str) and x for x in self.stop):
            raise ConfigError(
                f"env.stop={self.stop!r} must be a list of non-empty strings, e.g. "
                "env.stop='[\"</calc>\"]'."
            )
        if self.max_turns < 1:
            raise ConfigError(
                f"env.max_turns={self.max_turns} must be >= 1: the model's turns per episode."
            )
        _positive("env", self, "timeout_s", "num_workers")
        _non_negative("env", self, "max_turn_tokens")

    @property
    def multi_turn(self) -> bool:
        return bool(self.name)


@dataclass
class CheckpointConfig:
    interval: int = 0
    """Save every this many steps (0 = only at the end)."""
    keep_last: int = 2
    """Keep this many most recent checkpoints."""
    save_at_end: bool = True
    exact_resume: bool = True
    """Keep a copy of the weights vLLM serves (when sync.interval > 1) and save it in each
    checkpoint, so a run resumed between two syncs serves exactly the same lagged policy as
    an uninterrupted one. Without it, a resumed run pushes its current weights at start."""

    def __post_init__(self) -> None:
        _non_negative("checkpoint", self, "interval")
        _positive("checkpoint", self, "keep_last")


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    wandb_project: str | None = None
    """Log to Weights & Biases under this project when set (wandb must be installed)."""
    progress: bool = True
    """Show a progress bar with ETA on rank 0."""
    plots: bool = True
    """Write PNG plots of reward and step-time breakdown at the end of a run."""


@dataclass
class EvalConfig:
    """Validation during training: pass@1 on held-out prompts through the engines already up."""

    interval: int = 0
    """Evaluate every this many steps (after that step's sync, so it measures the weights vLLM
    serves then: ``policy_version``); 0 disables."""
    data: str = ""
    """Held-out prompts: a data file (same keys as ``data``), or empty for the ``test`` split
    of a ``synthetic:<task>`` training source."""
    num_prompts: int = 32
    """The first this many held-out prompts, the same at every evaluation."""
    samples: int = 1
    """Samples per prompt; pass@1 is the mean over them (with temperature 0: greedy accuracy)."""
    temperature: float = 0.0

    def __post_init__(self) -> None:
        _non_negative("eval", self, "interval")
        _positive("eval", self, "num_prompts", "samples")
        _non_negative("eval", self, "temperature")


@dataclass
class Config:
    """The whole run: every section, plus the loop's length and seed."""

    steps: int = 60
    seed: int = 1234
    run_dir: str = "runs/default"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        _check_positive("steps", self.steps)
        if (
            self.eval.interval
            and not self.eval.data
            and not self.data.source.startswith("synthetic:")
        ):
            raise ConfigError(
                f"eval.interval={self.eval.interval} needs held-out prompts: set eval.data to a "
                f"data file (data.source={self.data.source!r} has no built-in test split)."
            )
        _check_ranges(self)
        batch = self.grpo.batch.prompts_per_step * self.grpo.group_size
        if self.grpo.batch.mini_batch_size and batch % self.grpo.batch.mini_batch_size:
            raise ConfigError(
                f"grpo.batch.prompts_per_step({self.grpo.batch.prompts_per_step}) * grpo.group_size"
                f"({self.grpo.group_size}) = {batch} is not a multiple of "
                "grpo.batch.mini_batch_size"
                f"({self.grpo.batch.mini_batch_size}): pick a mini-batch size that divides {batch}."
            )
        if self.grpo.overlong_buffer > self.rollout.max_new_tokens:
            raise ConfigError(
                f"grpo.overlong_buffer({self.grpo.overlong_buffer}) exceeds rollout.max_new_tokens"
                f"({self.rollout.max_new_tokens}): the penalty ramps over the last buffer tokens of "
                "the response; lower it (0 disables)."
            )
        m = self.model
        if (
            self.grpo.batch.pack_sequences
            and m.local_attention == "unfused"
            and (m.transformer_impl != "transformer_engine")
        ):
            raise ConfigError(
                "grpo.batch.pack_sequences=true needs an attention that keeps packed sequences "
                "apart, "
                "but model.local_attention=unfused (megatron's DotProductAttention refuses "
                "them): set model.local_attention=sdpa or grpo.batch.pack_sequences=false."
            )
        _check_budget(self)
        _check_context_parallel(self)
        r = self.rollout
        if r.sleep_between_rollouts and r.sleep_level == 2 and self.sync.can_lag:
            every = (f"sync.interval={self.sync.interval}" if self.sync.mode == "fixed" else
                     f"sync.mode=adaptive with sync.max_interval={self.sync.max_interval}")  # fmt: skip
            raise ConfigError(
                f"rollout.sleep_level=2 discards vLLM's weights at every sleep, so every step "
                f"needs a weight sync, but {every}: set rollout.sleep_level=1 (weights wait in "
                "CPU memory) or sync.mode=fixed sync.interval=1."
            )
        if self.env.multi_turn and r.placement == "colocated" and r.tp > 1:
            raise ConfigError(
                f"env.name with rollout.placement=colocated needs rollout.tp=1, not {r.tp}: each "
                "TP rank of a colocated engine would run its own environments, and one timing "
                "out where another did not would split the engine's ranks; set rollout.tp=1 or "
                "rollout.placement=disaggregated (one driver runs the episodes)."
            )
        if self.rollout.max_new_tokens + self.data.max_prompt_tokens > self.rollout.max_model_len:
            raise ConfigError(
                f"data.max_prompt_tokens({self.data.max_prompt_tokens}) + rollout.max_new_tokens"
                f"({self.rollout.max_new_tokens}) exceeds rollout.max_model_len"
                f"({self.rollout.max_model_len}): raise rollout.max_model_len or shorten them."
            )


def _check_context_parallel(cfg: Config) -> None:
    """What ``parallel.cp`` > 1 does not run with yet, refused in one line
    (docs/context-parallel.md; the policy's own guard: ``policy.forward``)."""
    p, m = cfg.parallel, cfg.model
    if p.cp == 1:
        return
    why = context_parallel_gap(m.transformer_impl, m.local_attention, m.kernels.packed_rope, p.vpp)
    if why is not None:
        raise ConfigError(f"parallel.cp={p.cp} does not run with {why} or parallel.cp=1.")


def context_parallel_gap(
    transformer_impl: str, local_attention: str, packed_rope: bool, vpp: int | None
) -> str | None:
    """The first setting the context-parallel path does not run with yet, and its fix; None
    when it runs (the config's check and the policy's guard read this one list)."""
    if transformer_impl == "transformer_engine":
        return "model.transformer_impl=transformer_engine (TE's own CP is not wired): set local"
    if local_attention != "sdpa":
        return f"model.local_attention={local_attention}: set sdpa"
    if not packed_rope:
        return "model.kernels.packed_rope=false: set true (RoPE of each rank's positions)"
    if vpp:
        return f"parallel.vpp={vpp} (untested): set parallel.vpp=null"
    return None


def _check_budget(cfg: Config) -> None:
    """A packed micro-batch holds at least one whole sequence: a smaller explicit budget."""
    g, seq = cfg.grpo, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    budget = g.batch.micro_batch_tokens
    if g.batch.pack_sequences and isinstance(budget, int) and budget != 0 and budget < seq:
        raise ConfigError(
            f"grpo.batch.micro_batch_tokens={g.batch.micro_batch_tokens} is smaller than the "
            "longest "
            f"sequence, data.max_prompt_tokens({cfg.data.max_prompt_tokens}) + "
            f"rollout.max_new_tokens({cfg.rollout.max_new_tokens}) = {seq}, which never splits: "
            f"set grpo.batch.micro_batch_tokens >= {seq}, or auto."
        )


def _check_ranges(cfg: Config) -> None:
    """Ranges of the numeric keys the section checks leave open (a value out of range was
    accepted and only failed, or silently misbehaved, deep in a run)."""
    r, g, o = cfg.rollout, cfg.grpo, cfg.optim
    _positive("rollout", r, "cpu_kv_cache_gb")
    _non_negative("grpo", g, "advantage_eps")
    _positive("grpo", g, "red_weight_tau")
    _non_negative("grpo.loss", g.loss, "rec_ring_eps_low", "rec_ring_eps_high",
                  "regularizer_coef", "loss_agg_constant")  # fmt: skip
    _non_negative("grpo", g, "overlong_penalty")
    _positive("grpo.off_policy", g.off_policy, "tis_cap")
    _non_negative("optim", o, "weight_decay")
    _positive("optim", o, "adam_eps")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(o, key) < 1:
            raise ConfigError(f"optim.{key}={getattr(o, key)} must be in [0, 1).")


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
