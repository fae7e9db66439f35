"""``bench train``'s two sides (the command: ``bench/train/run.py``): the project's ``Policy``
and the plain Hugging Face baseline, behind the same four calls (``num_parameters``,
``logprobs``, ``train_step``, ``close``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

import torch

from megatron_grpo.algorithms.aggregation import GRPOLoss
from megatron_grpo.algorithms.step_batch import LossBatch, Rows
from megatron_grpo.bench.train.args import BenchTrainArgs
from megatron_grpo.bench.train.batch import micro_batches
from megatron_grpo.config.schema import KernelsConfig, ModelConfig, OptimConfig
from megatron_grpo.layouts import hf as hf_names
from megatron_grpo.layouts import megatron as mg_names
from megatron_grpo.layouts.io import gather_hf_state_dict
from megatron_grpo.models.spec import ModelSpec
from megatron_grpo.models.tiny import hf_config_dict
from megatron_grpo.policy.kernels import resolve_kernels, use_liger
from megatron_grpo.policy.logprob import token_logprobs
from megatron_grpo.policy.micro_batches import PackedRows, packed_micro_batches
from megatron_grpo.policy.policy import build_policy

R = TypeVar("R", bound=Rows)


class ProjectSide:
    """The project's ``Policy`` at world size 1 (``project``); with ``padded`` the same
    policy on padded rows of ``micro_batch_size`` (``project-padded``, the trainer's
    ``grpo.batch.pack_sequences=false``)."""

    def __init__(
        self, spec: ModelSpec, ctx, args: BenchTrainArgs, padded: bool = False,
        shards: dict[str, torch.Tensor] | None = None,
    ) -> None:  # fmt: skip
        """``shards``: another side's ``shards()`` to start from (the same initial weights)."""
        self.name = "project-padded" if padded else "project"
        if padded:
            args = dataclasses.replace(args, micro_batch_tokens=0)
        self.spec, self.args = spec, args
        kernels = KernelsConfig(liger=args.liger)  # --liger: both sides, or neither
        model_cfg = ModelConfig(dtype=args.dtype, recompute=args.recompute, kernels=kernels)
        self.kernels = resolve_kernels(model_cfg, ctx.device)
        self.policy = build_policy(spec, ctx, model_cfg, OptimConfig(lr=args.lr), temperature=1.0)
        self.ctx = ctx
        if shards is not None:
            with torch.no_grad():
                for name, p in self.policy.named_shards():
                    p.copy_(shards[name])
            self.policy.optimizer.reload_model_params()  # as Policy.copy_weights_from

    def shards(self) -> dict[str, torch.Tensor]:
        """This rank's parameter shards, copied to the CPU."""
        return {n: p.detach().cpu().clone() for n, p in self.policy.named_shards()}

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

    def logprobs(self, batch: Rows) -> dict[str, torch.Tensor]:
        return self.policy.compute_logprobs(batch, **self.sizes())

    def train_step(self, batch: LossBatch, loss_fn: GRPOLoss) -> dict[str, float]:
        m = self.policy.train_step(batch, loss_fn, **self.sizes())
        return {"loss": m["loss"], "grad_norm": m["grad_norm"]}

    def close(self) -> None:
        del self.policy  # its memory is freed before the next side is built


VARLEN_ATTENTION = "megatron_grpo_varlen"
"""The attention the ``hf-packed`` side registers with transformers' ``AttentionInterface``:
the project's own packed attention (``policy.attention.packed_attention``: ``varlen_attn`` on
CUDA, the exact per-document op on CPU), so both packed sides run the same kernel. A name
transformers has no mask function for gets no mask built (masking_utils.py
``_preprocess_mask_arguments``): the documents' bounds are the mask."""


def _varlen_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """transformers' attention signature over one pack: query [1, h, T, d] (RoPE applied
    from ``position_ids``), the pack's ``packed`` params in ``kwargs``; [1, T, h, d]."""
    from types import SimpleNamespace

    from megatron_grpo.policy.attention import packed_attention

    pack = kwargs["packed"]
    params = SimpleNamespace(bounds=pack.bounds, cu_seqlens_q=pack.cu_seqlens, rope=None)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = packed_attention(q, k, v, params, scale)
    return out.view(1, q.shape[0], q.shape[1], -1), None


def _register_varlen_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, _varlen_attention)


def apply_liger(model, device: torch.device, choice: str) -> bool:
    """Liger-Kernel's fused RMSNorm / SwiGLU / RoPE on ``model`` (``--liger``: ``auto`` where
    it is installed and the device is CUDA, ``on``, ``off``: ``policy.kernels.use_liger``,
    the rule the project side's ``model.kernels.liger`` follows); True when applied. Its
    fused cross-entropy stays off: the log-probs are the project's function on both sides."""
    if not use_liger(choice, "local", device, key="--liger"):
        return False
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(
        model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
        fused_linear_cross_entropy=False,
    )  # fmt: skip
    return True


def _moe_keys(spec: ModelSpec) -> dict[str, Any]:
    """The HF ``config.json`` keys of an MoE spec's experts (none for a dense one)."""
    if not spec.is_moe:
        return {}
    keys: dict[str, Any] = {
        "num_experts": spec.num_experts, "num_experts_per_tok": spec.moe_topk,
        "moe_intermediate_size": spec.moe_ffn_hidden_size, "norm_topk_prob": spec.norm_topk_prob,
    }  # fmt: skip
    if spec.shared_expert_ffn_hidden_size:
        keys["shared_expert_intermediate_size"] = spec.shared_expert_ffn_hidden_size
    return keys


def _fuse_experts(state: dict) -> dict:
    """Checkpoint names -> transformers' (v5) fused experts in memory: the inverse of
    ``models.prepare.unfuse_experts`` (``mlp.experts.gate_up_proj`` (E, 2I, h), gate rows
    first, and ``mlp.experts.down_proj`` (E, h, I))."""
    out: dict = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in state.items():
        pre, dot, rest = name.partition(".mlp.experts.")
        if dot and rest.split(".")[0].isdigit():
            e, proj = rest.split(".")[:2]
            experts.setdefault(pre, {}).setdefault(int(e), {})[proj] = t
        else:
            out[name] = t
    for pre, by_e in experts.items():
        order = [by_e[e] for e in sorted(by_e)]
        out[f"{pre}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([x["gate_proj"], x["up_proj"]]) for x in order]
        )
        out[f"{pre}.mlp.experts.down_proj"] = torch.stack([x["down_proj"] for x in order])
    return out


def _hf_model(
    spec: ModelSpec, state: dict, device: torch.device, dtype: torch.dtype, attention: str
):
    """A ``transformers`` causal LM of ``spec`` on ``device`` with the project's weights
    ``state`` (an HF state dict) loaded; raises when the two disagree on a name."""
    import transformers

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
            **_moe_keys(spec),
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
            config, attn_implementation=attention, dtype=dtype
        )
    if any(k.endswith(".mlp.experts.gate_up_proj") for k in model.state_dict()):
        state = _fuse_experts(state)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied_head = [hf_names.LM_HEAD] if spec.tie_word_embeddings else []
    if unexpected or [k for k in missing if k not in tied_head]:
        raise ValueError(
            f"HF model and the project's weights disagree: missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}"
        )
    return model


class HFSide:
    """A plain ``transformers`` causal LM of the same spec, SDPA attention, AdamW (``hf``);
    with ``packed_budget`` the same model with padding removed (``hf-packed``): rows packed
    end to end under the project's token budget, positions restarting per document, the
    project's varlen attention, and Liger's kernels where installed (``apply_liger``)."""

    def __init__(
        self,
        spec: ModelSpec,
        state: dict,
        device: torch.device,
        dtype: torch.dtype,
        args: BenchTrainArgs,
        packed_budget: int | None = None,
        fused_adam: bool | None = None,
    ) -> None:
        """``fused_adam``: torch's fused AdamW (None: on CUDA only, as ``bench train``)."""
        self.spec, self.args, self.device = spec, args, device
        self.packed_budget = packed_budget
        self.name = "hf" if packed_budget is None else "hf-packed"
        attention = "sdpa"
        if packed_budget is not None:
            _register_varlen_attention()
            attention = VARLEN_ATTENTION
        model = _hf_model(spec, state, device, dtype, attention)
        if args.recompute == "full":
            model.gradient_checkpointing_enable()
        self.liger = packed_budget is not None and apply_liger(model, device, args.liger)
        self.model = model
        opt = OptimConfig(lr=args.lr)
        self.clip = opt.clip_grad
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=opt.lr,
            betas=(opt.adam_beta1, opt.adam_beta2),
            eps=opt.adam_eps,
            weight_decay=opt.weight_decay,
            fused=device.type == "cuda" if fused_adam is None else fused_adam,
        )

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())  # tied weights counted once

    def _micro_batches(self, batch: R) -> Sequence[tuple[slice, int, R, PackedRows | None]]:
        if self.packed_budget is None:
            return [
                (r, n, mb, None) for r, n, mb in micro_batches(batch, self.args.micro_batch_size)
            ]
        return packed_micro_batches(batch, self.packed_budget)

    def _logp_entropy(self, ids: torch.Tensor, pack: PackedRows | None):
        """``logp``, ``entropy`` [n, L] of the micro-batch's rows ``ids`` (on the device)."""
        if pack is None:
            logits = self.model(input_ids=ids, use_cache=False).logits
            return token_logprobs(logits, ids, vocab_start=0, vocab_size=self.spec.vocab_size)
        pack = pack.on({k: v.to(self.device) for k, v in pack.tensors().items()})
        logits = self.model(input_ids=pack.input_ids, position_ids=pack.positions.unsqueeze(0),
                            use_cache=False, packed=pack).logits  # fmt: skip
        logp, ent = token_logprobs(
            logits, pack.input_ids, vocab_start=0, vocab_size=self.spec.vocab_size
        )
        shape = (ids.shape[0], ids.shape[1])  # [n, L]
        return pack.unpack(logp, shape), pack.unpack(ent, shape)

    @torch.no_grad()
    def logprobs(self, batch: Rows) -> dict[str, torch.Tensor]:
        """Like ``Policy.compute_logprobs``: [B, L] fp32 on the CPU, 0 on padding."""
        self.model.eval()
        assert batch.attention_mask is not None
        out = torch.zeros(2, *batch.input_ids.shape, device=self.device)
        for rows, length, mb, pack in self._micro_batches(batch):
            logp, ent = self._logp_entropy(mb.input_ids.to(self.device), pack)
            out[0, rows, :length] = logp.float()[:, :length]
            out[1, rows, :length] = ent.float()[:, :length]
        out *= batch.attention_mask.to(self.device)
        out = out.cpu()
        return {"logp": out[0], "entropy": out[1]}

    def train_step(self, batch: LossBatch, loss_fn: GRPOLoss) -> dict[str, float]:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for _, _, mb, pack in self._micro_batches(batch):
            dev = mb.with_tensors({k: v.to(self.device) for k, v in mb.tensors().items()})
            logp, ent = self._logp_entropy(dev.input_ids, pack)
            loss, _ = loss_fn(logp, ent, dev)
            loss.backward()
            total += loss.detach().float()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        return {"loss": float(total), "grad_norm": float(grad_norm)}

    def close(self) -> None:
        del self.model, self.optimizer  # their memory is freed before the next side is built
