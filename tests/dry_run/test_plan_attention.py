"""``plan``'s activation model follows the attention kernel and the micro-batch packing
(dry_run/memory.py): megatron's unfused attention adds its [b, heads, s, s] scores, SDPA and
Transformer-Engine do not, and packed micro-batches count the token budget.

The figures measured on one H100 (issue 22; bf16, the Qwen2.5-0.5B shape, one sequence per
micro-batch): the unfused path does not fit 8,192 tokens in 80 GiB, and with SDPA a
16,384-token sequence trains in 39.7 GiB.
"""

from __future__ import annotations

import pytest

from megatron_grpo.config.schema import Config, DataConfig, ModelConfig, RolloutConfig
from megatron_grpo.dry_run.memory import GIB, activation_bytes, estimate_memory
from megatron_grpo.models.spec import spec_from_hf_config
from megatron_grpo.models.tiny import hf_config_dict
from tests.helpers.configs import grpo_config

SPEC = spec_from_hf_config(hf_config_dict("Qwen2.5-0.5B"))


def _cfg(
    seq: int, *, attention="sdpa", rows=1, pack=False, budget=0, impl="local", logprob="auto"
) -> Config:
    return Config(
        model=ModelConfig(local_attention=attention, transformer_impl=impl, logprob_impl=logprob),
        grpo=grpo_config(
            micro_batch_size=rows, pack_sequences=pack, micro_batch_tokens=budget,
            prompts_per_step=1, group_size=2,
        ),
        data=DataConfig(max_prompt_tokens=seq // 2),
        rollout=RolloutConfig(max_new_tokens=seq // 2, max_model_len=seq),
    )  # fmt: skip


def _train_peak(cfg: Config) -> float:
    """GiB of one training GPU (disaggregated: no vLLM on it), without the served copy the
    loop keeps for exact resume (a benchmark's policy has none)."""
    m = estimate_memory(SPEC, cfg, dp=1, num_engines=1, colocated=False, capacity_bytes=80 * GIB)
    return (m.per_role["train"].total - m.per_role["train"].components["served"]) / GIB


def test_unfused_attention_counts_its_scores_quadratically():
    def extra(seq: int) -> int:
        fused = activation_bytes(SPEC, _cfg(seq), dp=1, recompute=False)
        return activation_bytes(SPEC, _cfg(seq, attention="unfused"), dp=1, recompute=False) - fused

    assert extra(2048) > 0 and extra(4096) == 4 * extra(2048)
    # Transformer-Engine's attention holds no scores either, whatever local_attention says
    te = _cfg(4096, attention="unfused", impl="transformer_engine")
    assert activation_bytes(SPEC, te, dp=1, recompute=False) == activation_bytes(
        SPEC, _cfg(4096), dp=1, recompute=False
    )


def test_peaks_agree_with_the_h100_figures():
    assert _train_peak(_cfg(8192, attention="unfused")) > 80  # did not fit in 80 GB
    # measured with the logits path (model.logprob_impl=logits), before the fused scoring
    assert _train_peak(_cfg(16384, logprob="logits")) == pytest.approx(39.7, rel=0.15)
    # the fused scoring (the default) holds no bf16 [16384, 151936] logits (3 copies, 13.9 GiB)
    # and 4 fp32 chunk temporaries instead of 6 (-1.2 GiB), but the output weight's gradient
    # (fp32 sum and two bf16 copies, 1.0 GiB) and the hidden states' copies (0.05 GiB)
    drop = _train_peak(_cfg(16384, logprob="logits")) - _train_peak(_cfg(16384))
    assert drop == pytest.approx(13.9 + 1.16 - 1.01 - 0.05, abs=0.02), drop


def test_packed_micro_batches_count_the_token_budget():
    padded = activation_bytes(SPEC, _cfg(1024, rows=4), dp=1, recompute=False)
    # default budget: micro_batch_size full-length sequences, the same memory as padded rows
    assert activation_bytes(SPEC, _cfg(1024, rows=4, pack=True), dp=1, recompute=False) == padded
    half = activation_bytes(SPEC, _cfg(1024, rows=4, pack=True, budget=2048), dp=1, recompute=False)
    assert half < padded
    # a budget of one sequence holds what one padded row holds (a smaller budget is refused
    # when the config loads: a sequence never splits, tests/dry_run/test_plan_budget.py)
    seq = activation_bytes(SPEC, _cfg(1024, rows=4, pack=True, budget=1024), dp=1, recompute=False)
    assert seq == activation_bytes(SPEC, _cfg(1024, rows=1), dp=1, recompute=False)
