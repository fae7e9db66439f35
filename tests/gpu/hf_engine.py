"""A rollout engine for machines without vLLM: transformers samples, the real bridge feeds it.

The GPU machine has torch and the megatron-core wheel but no vLLM (its CUDA build cannot be
carried there), and the GPU suite must still run ``GRPOTrainer.run()`` itself: the real
policy build, log-probs, train steps, checkpoints, the colocated offload/reload, and syncs
through the real resharding bridge (pack, transport, unpack on the device). ``HFEngine``
stands where ``rollout.engine.RolloutEngine`` stands in a colocated run:

- it is the bridge's sink (``LocalEngine``): ``begin_weight_update().receive_shard(name, t)``
  takes each shard in **vLLM's layout** (fused ``qkv_proj``, ``gate_up_proj``, padded vocab
  rows stripped) as the transport completes it; ``finish_weight_update`` writes every shard
  back into Hugging Face tensors with the project's one slice algebra
  (``layouts.vllm.shard`` -> ``layouts.pieces.scatter``) and loads them into the model, so a
  wrong slice anywhere in the bridge changes what the rollouts sample;
- it samples (``generate``) with the contract of ``rollout.engine_protocol.Engine``: ``n``
  samples per prompt, prompt-major, one seed per request, the sampled token's log-prob
  under ``softmax(logits / T)`` (vLLM's ``processed_logprobs``), stop strings and
  per-request token limits (a multi-turn episode's turn, ``rollout.agent``);
- it sleeps and wakes like vLLM's sleep mode (weights to the host and back), so
  ``trainer.colocated_memory.ColocatedMemory`` runs its whole dance around it on a GPU.

Sampling recomputes the whole sequence for every new token (no KV cache): the suite's
responses are a few tokens long.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from megatron_grpo.bridge.transfer_group import PlanInputs
from megatron_grpo.bridge.weight_sync import colocated_sender
from megatron_grpo.distributed.placement import colocated_engines
from megatron_grpo.layouts import vllm as vl
from megatron_grpo.layouts.pieces import scatter
from megatron_grpo.models.spec import load_spec
from megatron_grpo.rollout.colocated import ColocatedRollout
from megatron_grpo.rollout.samples import Sample


class _Receiver:
    def __init__(self) -> None:
        self.shards: dict[str, torch.Tensor] = {}

    def receive_shard(self, name: str, tensor: torch.Tensor) -> None:
        self.shards[name] = tensor.detach().clone()


class HFEngine:
    """One rollout TP rank (rollout.tp = 1) served by a transformers model on ``device``."""

    def __init__(self, hf_dir: Any, device: torch.device, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.spec = load_spec(hf_dir)
        self.hf_dir, self.tokenizer = str(hf_dir), None
        self.tp, self.seed, self.replica_index = 1, 0, 0
        self.device, self.dtype = device, dtype
        self.model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).to(device)
        self.model.eval()
        self._receiver: _Receiver | None = None
        self.updates = 0
        self.asleep = False

    # -------------------------------------------------------------- the bridge's sink
    def begin_weight_update(self, record_checksums: bool = False) -> _Receiver:
        self._receiver = _Receiver()
        return self._receiver

    def finish_weight_update(self) -> float:
        t0 = time.perf_counter()
        shards, self._receiver = self._receiver.shards, None
        expected = set(vl.param_names(self.spec))
        if set(shards) != expected:
            raise AssertionError(
                f"the bridge delivered {sorted(set(shards) ^ expected)[:4]} unlike vLLM's "
                "parameter set"
            )
        state = self.model.state_dict()
        full = {n: torch.empty_like(t) for n, t in state.items()}
        for name, t in shards.items():
            scatter(vl.shard(self.spec, 1, 0, name), t.to(self.device, self.dtype), full)
        if self.spec.tie_word_embeddings and "lm_head.weight" in full:
            full["lm_head.weight"] = full["model.embed_tokens.weight"]
        self.model.load_state_dict(full, strict=True)
        self.updates += 1
        return time.perf_counter() - t0

    def update_phases(self, stats: Any) -> None:
        pass

    # ------------------------------------------------------------------ sleep mode
    def sleep(self, level: int = 1) -> None:
        self.model.to("cpu")
        self.asleep = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self.asleep:
            self.model.to(self.device)
            self.asleep = False

    # --------------------------------------------------------------------- sampling
    @torch.no_grad()
    def generate(
        self,
        prompt_token_ids: list,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        max_new_tokens: int = 16,
        stop_token_ids: list[int] | None = None,
        seeds: list[int] | None = None,
        seed: int | None = None,
        stop: list[str] | None = None,
        max_tokens_each: list[int] | None = None,
    ) -> list[Sample]:
        if self.asleep:
            raise RuntimeError("generate() on a sleeping engine: wake_up() first")
        if top_p != 1.0 or (top_k and top_k > 0):
            raise ValueError("HFEngine samples the full distribution only (top_p=1, top_k=-1)")
        stop_ids = set(stop_token_ids or ())
        out: list[Sample] = []
        for i, prompt in enumerate(prompt_token_ids):
            first = seeds[i] if seeds is not None else (seed or 0) + i * n
            limit = max_tokens_each[i] if max_tokens_each is not None else max_new_tokens
            for j in range(n):
                gen = torch.Generator(device=self.device).manual_seed(first + j)
                ids = torch.tensor([list(prompt)], device=self.device)
                resp: list[int] = []
                logps: list[float] = []
                finish = "length"
                for _ in range(limit):
                    logits = self.model(ids).logits[0, -1, : self.spec.vocab_size].float()
                    logp = torch.log_softmax(logits / temperature, -1)
                    tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                    resp.append(tok)
                    logps.append(float(logp[tok]))
                    ids = torch.cat([ids, torch.tensor([[tok]], device=self.device)], 1)
                    if tok in stop_ids or (stop and self._ends_turn(resp, stop)):
                        finish = "stop"
                        break
                out.append(Sample(list(prompt), resp, logps, finish, str(self.updates)))
        return out

    def _ends_turn(self, resp: list[int], stop: list[str]) -> bool:
        """A stop string completed by the last token (kept in the tokens, as vLLM keeps it)."""
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.hf_dir)
        text = self.tokenizer.decode(resp, skip_special_tokens=True)
        return any(s in text for s in stop)

    def shutdown(self) -> None:
        self.model = None


def hf_rollout_factory(cfg: Any, world: Any, ctx: Any, hf_dir: Any, policy: Any):
    """``trainer.build.build_trainer``'s ``rollout_factory``: an ``HFEngine`` on this rank
    behind the colocated rollout and the real direct sender (``rollout.tp`` must be 1)."""
    if world is not None or cfg.rollout.tp != 1:
        raise ValueError("the HF test engine serves colocated rollout.tp=1 runs only")
    dtype = next(iter(dict(policy.named_shards()).values())).dtype
    engine = HFEngine(hf_dir, ctx.device, dtype)
    engines = colocated_engines(ctx.world_size, 1)
    inputs = PlanInputs.of(hf_dir, ctx, policy, cfg.sync, 1, engines)
    sender = colocated_sender(inputs, policy.spec, ctx, engine, cfg.sync)
    return ColocatedRollout(engine, ctx, 1), sender
