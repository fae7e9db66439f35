"""Issue 6: a checkpoint written by ``megatron-grpo train`` converts to HF and loads in vLLM.

One short training run (2 steps, tiny model), converted by ``convert mcore-to-hf --ckpt
RUN/checkpoints/step_000002`` (the training step directory itself). The converted HF
directory, loaded by plain vLLM, must give the same greedy responses as ``megatron-grpo eval
--model RUN/checkpoints/step_000002`` (Megatron checkpoint -> policy -> bridge -> vLLM that
started from dummy weights), and the same prompt logprobs as the Megatron policy loaded
from the checkpoint (within 1e-4): the converted weights are the trained ones.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers.commands import cli, read_dump, run, vllm_reference

pytestmark = pytest.mark.slow

TRAIN = [
    "--steps", "2", "grpo.group_size=4", "grpo.batch.prompts_per_step=4", "grpo.batch.micro_batch_size=16",
    "rollout.max_new_tokens=4", "rollout.cpu_kv_cache_gb=0.25", "model.warm_start_steps=20",
    "logging.progress=false", "logging.tensorboard=false", "logging.plots=false",
]  # fmt: skip

# The Megatron policy (TP=1) filled from the training checkpoint; logprobs of fixed sequences.
POLICY_LOGP = r"""
import json, sys

def main():
    from megatron_grpo.bridge.verify import fixed_sequences, pad_batch
    from megatron_grpo.config.schema import ModelConfig, ParallelConfig
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.policy.policy import build_policy
    from megatron_grpo.evaluation.source import load_megatron_weights, resolve_model

    source = resolve_model(sys.argv[1])
    spec = load_spec(source.hf_dir)
    with distributed_context(ParallelConfig(tp=1, pp=1, backend="gloo"), spec) as ctx:
        policy = build_policy(spec, ctx, ModelConfig(dtype="float32", transformer_impl="local"))
        load_megatron_weights(policy, source)
        seqs = fixed_sequences(spec.vocab_size)
        logp = policy.compute_logprobs(pad_batch(seqs), micro_batch_size=len(seqs))["logp"]
    # logp[:, t]: token t given tokens < t (0 at t = 0; bridge/verify.py logprob_parity)
    out = {"seqs": seqs, "logp": [logp[i, 1 : len(s)].tolist() for i, s in enumerate(seqs)]}
    open(sys.argv[2], "w").write(json.dumps(out))

if __name__ == "__main__":
    main()
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("train_to_hf") / "run"
    rc, out = cli("train", "--run-dir", str(run_dir), *TRAIN, timeout=400)
    assert rc == 0, out[-4000:]
    step = run_dir / "checkpoints" / "step_000002"
    assert (step / "state.json").is_file(), out[-2000:]
    return step


@pytest.mark.timeout(200)
def test_convert_finds_the_runs_own_model(trained, tmp_path):
    """Issue 47 item 6: a run's checkpoints/ converts without --hf-config, as eval finds it:
    the config and tokenizer come from the model the run's config.yaml names."""
    rc, out = cli("convert", "mcore-to-hf", "--ckpt", str(trained.parent),
                  "--out", str(tmp_path / "hf"))  # fmt: skip
    assert rc == 0, out[-2000:]
    # a quiet console (item 3): the project's lines here, library warnings in convert.log
    assert len(out.splitlines()) <= 15 and "Warning" not in out, out
    assert (tmp_path / "convert.log").is_file()
    base = trained.parent.parent / "hf_model" / "tiny"
    got, want = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "hf", base))
    assert {**got, "dtype": None, "torch_dtype": None} == {
        **want,
        "dtype": None,
        "torch_dtype": None,
    }
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


@pytest.mark.timeout(600)
def test_trained_checkpoint_to_hf_loads_in_vllm(trained, tmp_path):
    from transformers import AutoTokenizer

    from megatron_grpo.rewards.synthetic import synthetic_example

    base_hf = trained.parent.parent / "hf_model" / "tiny"
    hf = tmp_path / "hf"
    # convert accepts the training step directory itself (its trained weights are the
    # policy/ part). (Once: a test of this command alone launched the same conversion.)
    rc, out = cli("convert", "mcore-to-hf", "--ckpt", str(trained), "--out", str(hf),
                  "--hf-config", str(base_hf))  # fmt: skip
    assert rc == 0, out[-3000:]

    data = tmp_path / "add.jsonl"
    rows = [synthetic_example("add", 1, i, "test") for i in range(6)]
    data.write_text("".join(json.dumps({"question": p, "answer": a}) + "\n" for p, a in rows))
    dump = tmp_path / "eval.jsonl"
    rc, out = cli("eval", "--model", str(trained), "--data", str(data), "--max-new-tokens", "6",
                  "--greedy", "--dump", str(dump), "reward.name=synthetic",
                  "rollout.cpu_kv_cache_gb=0.25")  # fmt: skip
    assert rc == 0, out[-4000:]
    assert "training checkpoint, step 2" in out
    # issue 47 item 3: the report and at most a few lines of the project's own; vLLM INFO and
    # library warnings in eval.log beside the dump; no leaked-semaphore warning
    assert len(out.splitlines()) <= 15 and "leaked semaphore" not in out, out
    assert "INFO" in (tmp_path / "eval.log").read_text()
    got = [r["response_token_ids"] for r in read_dump(dump)]

    script, logp_file = tmp_path / "policy_logp.py", tmp_path / "policy_logp.json"
    script.write_text(POLICY_LOGP)
    rc, out = run([sys.executable, str(script), str(trained), str(logp_file)], 300)
    assert rc == 0, out[-3000:]
    policy = json.loads(logp_file.read_text())

    tok = AutoTokenizer.from_pretrained(hf)
    prompts = [tok(p).input_ids for p, _ in rows]
    ref = vllm_reference(hf, prompts, tok.eos_token_id, 6, tmp_path, policy["seqs"])
    assert got == ref["responses"]
    # GRPO moved the weights: the converted ones are not the warm start the run began with.
    from safetensors.torch import load_file

    trained_w = load_file(next(hf.glob("*.safetensors")))
    start_w = load_file(next(base_hf.glob("*.safetensors")))
    assert any(not (trained_w[k] == start_w[k]).all() for k in start_w)
    worst = max(
        abs(a - b)
        for pa, va in zip(policy["logp"], ref["prompt_logprobs"])
        for a, b in zip(pa, va, strict=True)
    )
    assert worst <= 1e-4, worst
