"""RoPE base read from transformers >= 5 configs, and Megatron/HF parity at rope_theta 1e6.

transformers 5 writes ``rope_parameters: {rope_type, rope_theta}`` into config.json and no
top-level ``rope_theta``. ``spec_from_hf_config`` used to read only the top-level key, so every
model built or saved with transformers 5 got Megatron ``rotary_base=10000``: the ``tiny``
preset (theta 1e4) hid it, while Qwen2.5 shapes (theta 1e6) drifted from HF and vLLM by
~1e-2..4e-1 in per-token log-probs even with bit-exact weights.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.helpers.batches import rows

LOGP_TOL = 1e-5


def _saved_config(tmp_path, **overrides) -> dict:
    """config.json exactly as the installed transformers writes it for the tiny preset."""
    import transformers

    from megatron_grpo.models.tiny import hf_config_dict

    cfg_dict = hf_config_dict("tiny", vocab_size=90, **overrides)
    config = transformers.AutoConfig.for_model(
        **{k: v for k, v in cfg_dict.items() if k != "architectures"}
    )
    config.architectures = cfg_dict["architectures"]
    config.save_pretrained(str(tmp_path))
    return json.loads((tmp_path / "config.json").read_text())


def test_spec_reads_rope_theta_as_saved_by_transformers(tmp_path):
    from megatron_grpo.models.spec import spec_from_hf_config

    cfg = _saved_config(tmp_path, rope_theta=1e6)
    assert spec_from_hf_config(cfg).rope_theta == 1e6


@pytest.mark.parametrize(
    "keys, theta",
    [
        ({"rope_theta": 5e5}, 5e5),  # transformers 4 layout
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, 1e6),  # 5
        ({}, 1e4),
    ],
)
def test_spec_rope_theta_layouts(keys, theta):
    from megatron_grpo.models.spec import spec_from_hf_config
    from megatron_grpo.models.tiny import hf_config_dict

    cfg = hf_config_dict("tiny", vocab_size=90)
    cfg.pop("rope_theta")
    cfg.update(keys)
    assert spec_from_hf_config(cfg).rope_theta == theta


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
        {"full_attention": {"rope_type": "default", "rope_theta": 1e6}},
    ],
)
def test_spec_refuses_non_default_rope_parameters(params):
    from megatron_grpo.models.spec import UnsupportedModelError, spec_from_hf_config
    from megatron_grpo.models.tiny import hf_config_dict

    cfg = hf_config_dict("tiny", vocab_size=90)
    cfg["rope_parameters"] = params
    with pytest.raises(UnsupportedModelError, match="rope_parameters"):
        spec_from_hf_config(cfg)


def _logp_worker(rank, world_size, hf_dir, batch):
    from megatron_grpo.config.schema import ModelConfig, ParallelConfig
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.layouts import load_hf_into_megatron
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.policy import build_policy

    spec = load_spec(hf_dir)
    with distributed_context(ParallelConfig(), spec, seed=1) as ctx:
        policy = build_policy(
            spec,
            ctx,
            ModelConfig(),
            None,
            init_weights=lambda chunks: load_hf_into_megatron(chunks, hf_dir, spec, ctx),
        )
        return policy.compute_logprobs(batch, 2)["logp"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_megatron_matches_hf_at_rope_theta_1e6(tmp_path):
    """tiny preset with Qwen2.5's rope_theta: 6e-3 off HF before the fix, ~1e-6 after."""
    from transformers import AutoModelForCausalLM

    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.models.tiny import build_hf_model

    hf_dir = build_hf_model(tmp_path / "m", "tiny", seed=0, rope_theta=1e6)
    g = torch.Generator().manual_seed(0)
    vocab = load_spec(hf_dir).vocab_size
    ids = torch.randint(3, vocab, (2, 48), generator=g)
    batch = rows(ids, torch.ones(2, 48))

    model = AutoModelForCausalLM.from_pretrained(
        str(hf_dir), dtype=torch.float64, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    ref = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]

    (logp,) = run_distributed(_logp_worker, 1, str(hf_dir), batch, timeout=150)
    d = (logp[:, 1:].double() - ref).abs().max().item()
    assert d < LOGP_TOL, f"Megatron vs HF(fp64) at rope_theta 1e6: {d:.2e}"
