"""Parity of the Megatron policy with `transformers`, and across (tp, pp) layouts.

Two tiny random Qwen2 models in HF format (QKV biases, GQA): tied embeddings with
num_kv_heads=2, and untied with num_kv_heads=1 (so tp=2 > ng exercises megatron's
all-gather path for query groups). For each layout (tp, pp) in {(1,1), (2,1), (1,2), (2,2)}
one spawned gloo group loads both models through ``megatron_grpo.layouts``, computes
per-token log-probs (compared with transformers' log_softmax on the same weights), takes one
optimizer step, and gathers the full HF weights back (compared with the (1,1) result).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_variant_dirs
from tests.dist_utils import run_distributed
from tests.helpers.numerics import check_rank_step
from tests.helpers.steps import MICRO_BATCH, hf_reference, make_batch, pg_loss

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
VARIANTS = {
    "tied": dict(tie_word_embeddings=True, num_key_value_heads=2),
    "untied": dict(tie_word_embeddings=False, num_key_value_heads=1),
}
LOGP_TOL = 1e-5
WEIGHT_TOL = 1e-6


def _layout_worker(rank, world_size, tp, pp, models, batch):
    from megatron_grpo.config.schema import ModelConfig, OptimConfig, ParallelConfig
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.layouts import gather_hf_state_dict, load_hf_into_megatron
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.policy import build_policy

    with distributed_context(ParallelConfig(tp=tp, pp=pp), seed=1) as ctx:
        out = {}
        for name, hf_dir in models.items():
            spec = load_spec(hf_dir)
            policy = build_policy(
                spec,
                ctx,
                ModelConfig(),
                # adam_eps well above the tiny gradients keeps Adam's first step smooth in the
                # gradient (update ~ lr*g/(|g|+eps)), so the comparison sees gradient errors
                # (~1e-8) instead of g/|g| flipping for near-zero gradients.
                OptimConfig(lr=1e-3, clip_grad=1.0, adam_eps=1e-2),
                init_weights=lambda chunks, d=hf_dir, s=spec: load_hf_into_megatron(
                    chunks, d, s, ctx
                ),
            )
            logp = policy.compute_logprobs(batch, MICRO_BATCH)
            n_tokens = float(batch.loss_mask.sum())
            metrics = policy.train_step(batch, partial(pg_loss, n_tokens=n_tokens), MICRO_BATCH)
            weights = gather_hf_state_dict(policy.models, spec, ctx)
            out[name] = {"logp": logp["logp"], "metrics": metrics, "weights": weights}
    return out


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, str]:
    return tiny_variant_dirs(tmp_path_factory, "parity", VARIANTS)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_logprobs_and_step_match_across_layouts(hf_models):
    from megatron_grpo.models.spec import load_spec

    torch.set_num_threads(1)
    vocab = load_spec(hf_models["tied"]).vocab_size
    batch = make_batch(vocab)
    refs = {name: hf_reference(d, batch) for name, d in hf_models.items()}

    # The four groups run at once: spawn and import time dominate on 2 cores.
    with ThreadPoolExecutor(len(LAYOUTS)) as pool:
        futures = {
            (tp, pp): pool.submit(
                run_distributed, _layout_worker, tp * pp, tp, pp, hf_models, batch, timeout=300
            )
            for tp, pp in LAYOUTS
        }
        results = {layout: f.result() for layout, f in futures.items()}

    report = []
    for name in VARIANTS:
        base = results[(1, 1)][0][name]
        for layout, ranks in results.items():
            for r, res in enumerate(ranks):
                # every rank gets the log-probs (broadcast from the last stage)
                check_rank_step(res[name], base, refs[name], tol=LOGP_TOL, loss_abs=1e-5,
                                label=f"{name} tp,pp={layout} rank {r}", report=report)  # fmt: skip
            weights = ranks[0][name]["weights"]
            assert weights.keys() == base["weights"].keys()
            diffs = {k: (weights[k] - base["weights"][k]).abs().max().item() for k in weights}
            worst = max(diffs, key=diffs.get)
            d_w = diffs[worst]
            report.append(f"{name} tp,pp={layout}: updated weights vs (1,1) {d_w:.2e} ({worst})")
            assert d_w < WEIGHT_TOL, report[-1]
        # the step really changed the weights (lr 1e-3, Adam: about lr per element)
        from safetensors.torch import load_file

        orig = load_file(str(Path(hf_models[name]) / "model.safetensors"))
        step = max((base["weights"][k] - orig[k]).abs().max().item() for k in orig)
        assert 1e-5 < step < 1e-2, f"{name}: one step moved weights by {step}"
    print("\n" + "\n".join(report))


@pytest.fixture(autouse=True)
def _under_nccl_ordering(monkeypatch):
    """Every layout runs under NCCL's point-to-point ordering emulated over gloo
    (``tests/nccl_rules.py``): megatron's pipeline schedule and the policy's collectives
    must not depend on gloo's forgiveness. ``WAIT=done``: the schedule hands received
    activations to GPU work, stream-ordered, which a plain ``wait()`` allows on NCCL."""
    from tests.nccl_rules import ENV, WAIT_ENV

    monkeypatch.setenv(ENV, "1")
    monkeypatch.setenv(WAIT_ENV, "done")
