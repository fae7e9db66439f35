"""The agent loop on a scripted engine (no vLLM): turns, masks, budgets, seeds, rewards,
failing environments; the built-in calculator; the wire format of episodes."""

from __future__ import annotations

import time

import pytest

from megatron_grpo.algorithms.seeds import turn_seed
from megatron_grpo.config.schema import EnvConfig
from megatron_grpo.environments.calculator import Calculator, CalculatorError, evaluate
from megatron_grpo.environments.contract import load_environment
from megatron_grpo.metrics.row import episode_metrics
from megatron_grpo.models.tiny import build_char_tokenizer
from megatron_grpo.rollout import messages
from megatron_grpo.rollout.agent import AgentLoop
from megatron_grpo.rollout.samples import Sample
from megatron_grpo.trainer.collate import collate

HERE = __name__


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("tok"))


class ScriptedEngine:
    """Answers each request with the next turn of a fixed script per prompt (keyed by the
    prompt's first token), log-prob -0.1 * (position + 1); records every call."""

    def __init__(self, tok, script: list[str]) -> None:
        self.tok, self.script, self.calls = tok, script, []

    def generate(self, prompts, *, n, seeds, max_new_tokens, max_tokens_each, stop, **_):
        assert n == 1
        self.calls.append({"prompts": [list(p) for p in prompts], "seeds": list(seeds),
                           "budgets": list(max_tokens_each), "stop": stop})  # fmt: skip
        out = []
        for p, budget in zip(prompts, max_tokens_each):
            turn = sum(1 for c in self.calls[:-1] for q in c["prompts"] if q[:1] == p[:1])
            text = self.script[min(turn, len(self.script) - 1)]
            ids = self.tok.encode(text, add_special_tokens=False)
            reason = "length" if len(ids) > budget else "stop"
            ids = ids[:budget]
            out.append(Sample(list(p), ids, [-0.1 * (i + 1) for i in range(len(ids))], reason,
                              weight_version="3"))  # fmt: skip
        return out


def _loop(tok, name=f"{__file__}:Calculator", **kw) -> AgentLoop:
    return AgentLoop(EnvConfig(name=name, stop=["</calc>"], **kw), tok, chat=False)


def _prompts(tok, texts):
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def test_episode_keeps_model_tokens_and_logprobs_exactly_and_masks_the_environment(tok):
    engine = ScriptedEngine(tok, ["<calc>12+34</calc>", "46<eos>"])
    prompts = _prompts(tok, ["a=", "b="])
    rows = [{"prompt": "a", "answer": "46"}, {"prompt": "b", "answer": "7"}]
    out = _loop(tok).generate(engine, prompts, rows, seeds=[100, 200], n=2, max_new_tokens=64)
    assert len(out) == 4  # prompt-major, n per prompt
    turn1 = tok.encode("<calc>12+34</calc>", add_special_tokens=False)
    reply = tok.encode("<result>46</result>", add_special_tokens=False)
    turn2 = tok.encode("46<eos>", add_special_tokens=False)
    for k, s in enumerate(out):
        assert s.prompt_ids == prompts[k // 2]
        assert s.response_ids == turn1 + reply + turn2  # the sampled tokens, not re-encoded
        assert s.response_mask == [1] * len(turn1) + [0] * len(reply) + [1] * len(turn2)
        lp1 = [-0.1 * (i + 1) for i in range(len(turn1))]
        lp2 = [-0.1 * (i + 1) for i in range(len(turn2))]
        assert s.logprobs == lp1 + [0.0] * len(reply) + lp2
        assert (s.turns, s.env_end, s.env_calls, s.weight_version) == (2, "done", 3, "3")
        assert s.model_tokens == len(turn1) + len(turn2)
    assert [s.env_reward for s in out] == [1.0, 1.0, 0.0, 0.0]
    # turn 2's context is exactly prompt + turn 1 + reply; seeds per episode and turn
    first, second = engine.calls
    assert first["seeds"] == [100, 101, 200, 201]
    assert second["seeds"] == [turn_seed(s, 1) for s in (100, 101, 200, 201)]
    assert second["prompts"][0] == prompts[0] + turn1 + reply
    assert first["stop"] == ["</calc>"] and first["budgets"] == [64] * 4
    assert second["budgets"] == [64 - len(turn1) - len(reply)] * 4
    # the trainer's batch: environment tokens out of the response mask, logprobs in place
    batch = collate(out, pad_id=0)
    p = len(prompts[0])
    assert batch.response_mask[0, p:].tolist()[: len(s.response_ids)] == s.response_mask
    assert batch.input_ids[0, p : p + len(s.response_ids)].tolist() == s.response_ids
    m = episode_metrics(out)
    assert m["turns_mean"] == 2 and m["env_calls"] == 12 and m["env_errors"] == 0
    assert m["env_token_frac"] == pytest.approx(len(reply) / len(s.response_ids))


def test_budget_and_max_turns_end_episodes(tok):
    engine = ScriptedEngine(tok, ["<calc>1+1</calc>"])  # calls the tool forever
    out = _loop(tok, max_turns=3).generate(
        engine, _prompts(tok, ["a="]), [{"answer": "2"}], seeds=[0], n=1, max_new_tokens=200
    )
    assert (out[0].turns, out[0].env_end, out[0].finish_reason) == (3, "max_turns", "stop")
    assert out[0].response_mask[-1] == 1  # the last reply is not appended
    out = _loop(tok, max_turns=9).generate(
        engine, _prompts(tok, ["a="]), [{"answer": "2"}], seeds=[0], n=1, max_new_tokens=40
    )
    s = out[0]
    assert (s.env_end, s.finish_reason) == ("truncated", "length")
    assert len(s.response_ids) <= 40 and s.response_mask[-1] == 1


class Raises:
    def __init__(self, row):
        self.row = row

    def step(self, text):
        raise RuntimeError("boom")


class BadType:
    def __init__(self, row):
        pass

    def step(self, text):
        return "just a string"


class Hangs:
    def __init__(self, row):
        pass

    def step(self, text):
        time.sleep(30)
        return None, 1.0


class FailsToBuild:
    def __init__(self, row):
        raise KeyError("answer")

    def step(self, text):
        return None, 1.0


@pytest.mark.parametrize(
    "cls, end",
    [
        ("Raises", "error"),
        ("BadType", "error"),
        ("Hangs", "timeout"),
        ("FailsToBuild", "error"),
    ],  # fmt: skip
)
def test_failing_environment_ends_the_episode_with_reward_zero_and_is_counted(
    tok, cls, end, caplog
):
    engine = ScriptedEngine(tok, ["1<eos>"])
    loop = _loop(tok, name=f"{__file__}:{cls}", timeout_s=0.5)
    t0 = time.monotonic()
    out = loop.generate(engine, _prompts(tok, ["a=", "b="]), [{}, {}], seeds=[0, 1], n=1,
                        max_new_tokens=16)  # fmt: skip
    assert time.monotonic() - t0 < 5  # a hung step is abandoned at its limit
    assert [(s.env_end, s.env_reward) for s in out] == [(end, 0.0)] * 2
    assert getattr(loop.runner.counts, end + "s") == 2
    logged = [r for r in caplog.records if "logged once" in r.getMessage()]
    assert len(logged) == 1  # the first occurrence only, with its input


@pytest.mark.parametrize(
    "name, says",
    [
        ("nope.py:X", "does not exist"),
        (f"{__file__}:Missing", "has no attribute"),
        (f"{__file__}:HERE", "not a class"),
        ("no_colon", "is not 'package.module:ClassName'"),
        (f"{__file__}:ScriptedEngine", "no step method"),
    ],
)
def test_bad_env_name_is_one_line(name, says):
    with pytest.raises(ValueError, match=says) as e:
        load_environment(name)
    assert "\n" not in str(e.value)


def test_calculator_is_safe_and_exact():
    assert str(evaluate("(12+34)*2 - 7/7")) == "91"
    assert Calculator({"answer": "5"}).step("x <calc>2+3</calc>") == ("<result>5</result>", None)
    assert Calculator({"answer": "5"}).step("so it is 5") == (None, 1.0)
    reply, _ = Calculator({"answer": "5"}).step("<calc>__import__('os')</calc>")
    assert reply.startswith("<result>error:")
    for bad in ("9**9**9", "1/0", "x+1", "f(2)", "(1" * 150, "2**0.5", "[1]"):
        with pytest.raises(CalculatorError):
            evaluate(bad)


def test_episodes_cross_the_control_channel_intact(tok):
    engine = ScriptedEngine(tok, ["<calc>1+1</calc>", "2<eos>"])
    out = _loop(tok).generate(engine, _prompts(tok, ["q="]), [{"answer": "2"}], seeds=[5], n=2,
                              max_new_tokens=64)  # fmt: skip
    back = messages.decode(messages.samples(out), "res/0/0", "engine 0", ("samples",)).body
    assert [vars(s) for s in back] == [vars(s) for s in out]
    one_turn = [Sample([1], [2, 3], [-0.5, -0.25], "stop")]
    assert [
        vars(s) for s in messages.decode(messages.samples(one_turn), "k", "p", ("samples",)).body
    ] == [vars(s) for s in one_turn]


def test_max_turn_tokens_caps_each_turn_and_the_cut_turn_goes_to_the_environment(tok):
    engine = ScriptedEngine(tok, ["<calc>12+34</calc>", "46<eos>"])
    loop = AgentLoop(EnvConfig(name=f"{__file__}:Calculator", stop=["</calc>"], max_turns=2,
                               max_turn_tokens=5), tok, chat=False)  # fmt: skip
    out = loop.generate(engine, _prompts(tok, ["a="]), [{"answer": "46"}], seeds=[0], n=1,
                        max_new_tokens=64)  # fmt: skip
    assert engine.calls[0]["budgets"] == [5]
    s = out[0]
    # turn 1 cut at 5 tokens ("<calc"), not a call: the environment scores it as the answer
    assert s.response_ids == tok.encode("<calc", add_special_tokens=False)
    assert (s.turns, s.env_end, s.env_reward, s.finish_reason) == (1, "done", 0.0, "stop")


QWEN_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chat_reply_is_the_templates_tool_turn_closing_the_models_turn(tok):
    from megatron_grpo.rollout.agent import ReplyEncoder

    plain = ReplyEncoder(tok, chat=True)  # the tiny template: "role: content\n"
    assert (plain.prefix, plain.suffix) == ("\ntool: ", "\nassistant: ")
    assert tok.decode(plain.encode("=5;", [7])) == "\ntool: =5;\nassistant: "
    tok.chat_template, old = QWEN_LIKE, tok.chat_template
    try:
        enc = ReplyEncoder(tok, chat=True)
        enc.eos_text = "<|im_end|>"  # as a Qwen tokenizer's EOS token reads
        assert enc.prefix == "<|im_end|>\n<|im_start|>tool\n"
        assert enc.suffix == "<|im_end|>\n<|im_start|>assistant\n"
        # a turn cut by a stop string is closed first; one that ended with EOS is not again
        assert enc.encode("=5;", [7]) == tok.encode(
            "<|im_end|>\n<|im_start|>tool\n=5;<|im_end|>\n<|im_start|>assistant\n",
            add_special_tokens=False,
        )
        assert enc.encode("=5;", [tok.eos_token_id]) == tok.encode(
            "\n<|im_start|>tool\n=5;<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
        )
    finally:
        tok.chat_template = old


class RoutedEngine(ScriptedEngine):
    """Also returns routed experts: one row per forwarded token, its value the row index."""

    def generate(self, prompts, **kw):
        import numpy as np

        out = super().generate(prompts, **kw)
        for s in out:
            rows = len(s.prompt_ids) + len(s.response_ids) - 1
            s.routed_experts = np.arange(rows, dtype=np.int16).reshape(rows, 1, 1)
        return out


def test_routed_experts_of_an_episode_cover_its_whole_transcript(tok):
    engine = RoutedEngine(tok, ["<calc>1+2</calc>", "3<eos>"])
    out = _loop(tok).generate(engine, _prompts(tok, ["q="]), [{"answer": "3"}], seeds=[1], n=1,
                              max_new_tokens=64)  # fmt: skip
    s = out[0]
    assert s.turns == 2
    assert s.routed_experts.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, 1, 1)
