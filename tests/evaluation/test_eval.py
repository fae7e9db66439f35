"""``megatron-grpo eval``: pass@k arithmetic, one-line errors, and greedy parity with vLLM.

The parity test is the bridge's end-to-end check through the public command: the HF
weights go into Megatron at TP=2, through the resharding bridge into colocated vLLM at
rollout TP 1 and 2, and the greedy responses must equal vLLM's own load of the same HF
directory token for token.
"""

from __future__ import annotations

import json

import pytest

from megatron_grpo.evaluation.evaluate import eval_world
from megatron_grpo.metrics.pass_at_k import mean_pass_at_k, pass_at_k
from tests.helpers.commands import cli, read_dump, vllm_reference


def test_pass_at_k_golden():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(8, 0, 8) == 0.0
    assert pass_at_k(1, 1, 1) == 1.0
    assert mean_pass_at_k([[True, False], [False, False]], 1) == pytest.approx(0.25)
    assert mean_pass_at_k([[True, False], [False, False]], 2) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_eval_world_is_the_lcm_of_trainer_ranks_and_rollout_tp():
    assert eval_world(2, 1, 1) == 2
    assert eval_world(2, 1, 2) == 2
    assert eval_world(2, 2, 8) == 8
    assert eval_world(3, 1, 2) == 6


def _one_line_error(capsys, argv: list[str], needle: str) -> None:
    from megatron_grpo.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: ") and needle in err, err


def test_errors_are_one_line(tmp_path, capsys):
    base = ["eval", "--model", str(tmp_path), "--max-new-tokens", "4"]
    _one_line_error(capsys, [*base, "--data", str(tmp_path / "nope.jsonl")], "nope.jsonl")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    _one_line_error(capsys, [*base, "--data", str(data)], "reward.name=")
    bad = [
        "eval",
        "--model",
        str(tmp_path / "missing"),
        "--data",
        str(data),
        "reward.name=synthetic",
    ]
    _one_line_error(capsys, bad, "missing")
    _one_line_error(capsys, [*base, "--data", str(data), "reward.name=synthetic"], "neither")
    _one_line_error(capsys, [*base, "--data", "synthetic:add", "--samples", "0"], "--samples")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_greedy_equals_vllm_direct_load(tmp_path):
    from transformers import AutoTokenizer

    from megatron_grpo.models.tiny import build_hf_model
    from megatron_grpo.rewards.synthetic import synthetic_example

    hf = build_hf_model(tmp_path / "hf", "tiny", seed=3)
    data = tmp_path / "add.jsonl"
    rows = [synthetic_example("add", 1, i, "test") for i in range(6)]
    data.write_text("".join(json.dumps({"question": p, "answer": a}) + "\n" for p, a in rows))
    tok = AutoTokenizer.from_pretrained(hf)
    prompts = [tok(p).input_ids for p, _ in rows]
    ref = vllm_reference(hf, prompts, tok.eos_token_id, 6, tmp_path)["responses"]
    assert any(len(r) > 1 for r in ref)  # not trivially all-EOS
    for rollout_tp in (1, 2):
        dump = tmp_path / f"tp2_r{rollout_tp}.jsonl"
        rc, out = cli("eval", "--model", str(hf), "--data", str(data), "--train-tp", "2",
                      "--rollout-tp", str(rollout_tp), "--max-new-tokens", "6", "--greedy",
                      "--dump", str(dump), "reward.name=synthetic",
                      "rollout.cpu_kv_cache_gb=0.25")  # fmt: skip
        assert rc == 0, out[-4000:]
        assert "pass@1" in out and "mean reward" in out
        got = read_dump(dump)
        assert [r["prompt"] for r in got] == [p for p, _ in rows]
        assert [r["response_token_ids"] for r in got] == ref, (rollout_tp, got, ref)
        for r in got:
            assert {"prompt", "response", "response_token_ids", "reward", "answer"} <= set(r)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_dump_logprobs_are_the_sampled_temperature(tmp_path):
    """Public contract: at rollout.temperature=0.5, the dump's vLLM ``logprobs`` and the
    Megatron ``policy_logprobs`` both equal an independent log_softmax(logits / 0.5)."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_grpo.models.tiny import build_hf_model
    from megatron_grpo.rewards.synthetic import synthetic_example

    hf = build_hf_model(tmp_path / "hf", "tiny", seed=5)
    data = tmp_path / "add.jsonl"
    rows = [synthetic_example("add", 1, i, "test") for i in range(3)]
    data.write_text("".join(json.dumps({"question": p, "answer": a}) + "\n" for p, a in rows))
    dump = tmp_path / "dump.jsonl"
    rc, out = cli("eval", "--model", str(hf), "--data", str(data), "--samples", "2",
                  "--max-new-tokens", "6", "--dump", str(dump), "reward.name=synthetic",
                  "rollout.temperature=0.5", "rollout.cpu_kv_cache_gb=0.25")  # fmt: skip
    assert rc == 0, out[-4000:]
    got = read_dump(dump)
    assert len(got) == 6
    model = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
    hot = 0.0
    for r in got:
        assert {"prompt", "prompt_token_ids", "response_token_ids", "logprobs",
                "policy_logprobs"} <= set(r)  # fmt: skip
        p, resp = r["prompt_token_ids"], r["response_token_ids"]
        ids = torch.tensor([p + resp])
        with torch.no_grad():
            logits = model(ids).logits[0, len(p) - 1 : -1].double()
        tgt = torch.tensor(resp)[:, None]
        ref = torch.log_softmax(logits / 0.5, -1).gather(1, tgt)[:, 0]
        t1 = torch.log_softmax(logits, -1).gather(1, tgt)[:, 0]
        for key in ("logprobs", "policy_logprobs"):
            diff = (torch.tensor(r[key], dtype=torch.float64) - ref).abs().max().item()
            assert diff < 1e-4, (key, diff, r)
        hot = max(hot, (ref - t1).abs().max().item())
    assert hot > 1e-2  # T matters on these tokens: a T=1 log-prob would have failed above
