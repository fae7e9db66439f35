"""``bench train``'s two sides (the command: ``bench/train.py``): the project's ``Policy``
and the plain Hugging Face baseline, behind the same four calls (``num_parameters``,
``logprobs``, ``train_step``, ``close``)."""

from __future__ import annotations

from typing import Any

import torch

from megatron_grpo.bench.train_args import BenchTrainArgs
from megatron_grpo.bench.train_batch import micro_batches
from megatron_grpo.config.schema import ModelConfig, OptimConfig
from megatron_grpo.layouts import hf as hf_names
from megatron_grpo.layouts import megatron as mg_names
from megatron_grpo.layouts.io import gather_hf_state_dict
from megatron_grpo.models.spec import ModelSpec
from megatron_grpo.models.tiny import hf_config_dict
from megatron_grpo.policy.logprob import token_logprobs
from megatron_grpo.policy.policy import build_policy


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
