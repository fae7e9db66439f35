"""reward.name=judge:HF_DIR: the judge's prompt, its verdict (by the choices' log-probs or a
regex), the checks before anything starts, and its server (requests batched into one engine
call) scored through the remote reward's client. The engine here is a fake with vLLM's
interface; the real one runs in tests/e2e/test_judge.py."""

from __future__ import annotations

import json
import math
import threading
from types import SimpleNamespace

import pytest

from megatron_grpo.config import ConfigError, load_config
from megatron_grpo.config.schema import RewardConfig
from megatron_grpo.rewards import build_reward, check_reward
from megatron_grpo.rewards.judge import (
    JudgeSpec,
    client_config,
    expected_value,
    parse_verdict,
    render,
)
from megatron_grpo.rewards.remote import reward_server
from megatron_grpo.rollout.judge import Batcher, Judge


def test_the_template_is_filled_from_the_item_and_keeps_unknown_braces():
    item = {"prompt": "1+1", "response": "2", "answer": "2", "level": 3}
    got = render("Q {prompt} R {response} A {answer} L {level} {x}", item)
    assert got == "Q 1+1 R 2 A 2 L 3 {x}"


def test_the_choices_verdict_is_the_expected_value_under_the_judge():
    assert expected_value([math.log(0.75), math.log(0.25)], [1.0, 0.0]) == pytest.approx(0.75)
    # only the choices' relative weight counts (renormalized over the choices)
    assert expected_value([-50.0, -50.0 + math.log(3)], [1.0, 0.0]) == pytest.approx(0.25)


@pytest.mark.parametrize(
    "text, got", [("Score: 0.5 because", 0.5), ("score 1", None), ("Score: x", None)]
)
def test_a_pattern_verdict_is_the_number_in_its_first_group(text, got):
    assert parse_verdict(r"Score: (\S+)", text) == got


class Tok:
    """A character tokenizer: token = ord(char)."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(chr(t) for t in x) for x in ids]


class Engine:
    """vLLM's interface as RolloutEngine has it: a token's log-prob is -(its value % 7) / 10,
    so each choice's log-prob is known; generation answers a canned text per prompt."""

    def __init__(self, answers=()):
        self.calls, self.answers = [], list(answers)

    def prompt_logprobs(self, seqs):
        self.calls.append(len(seqs))
        return [[-(t % 7) / 10 for t in s[1:]] for s in seqs]

    def generate(self, prompts, **kw):
        self.calls.append(len(prompts))
        return [
            SimpleNamespace(response_ids=[ord(c) for c in a]) for a in self.answers[: len(prompts)]
        ]


def judge(pattern="", answers=(), **kw):
    spec = JudgeSpec(model="m", template="{prompt}|{response}|", choices=("yes", "no"),
                     values=(1.0, 0.0), pattern=pattern, max_tokens=8, max_model_len=64,
                     cpu_kv_cache_gb=1.0, gpu_memory_utilization=0.1, seed=0, **kw)  # fmt: skip
    j = Judge.__new__(Judge)
    j.spec, j.tokenizer, j.engine = spec, Tok(), Engine(answers)
    j.choice_ids = [Tok().encode(c) for c in spec.choices]
    j.total_unparsed = 0
    return j


def test_choices_are_scored_by_their_log_probs_after_the_prompt():
    j = judge()
    items = [{"prompt": "a", "response": "b"}, {"prompt": "cc", "response": "d"}]
    rewards, unparsed = j.score(items)
    lp = {c: sum(-(ord(ch) % 7) / 10 for ch in c) for c in ("yes", "no")}
    want = math.exp(lp["yes"]) / (math.exp(lp["yes"]) + math.exp(lp["no"]))
    assert rewards == pytest.approx([want, want]) and unparsed == 0
    assert j.engine.calls == [4]  # one engine call: 2 items x 2 choices


def test_a_long_prompt_keeps_its_end_so_the_question_to_the_judge_stays():
    j = judge()
    ids = j._prompt_ids({"prompt": "x" * 200, "response": "y"})
    assert len(ids) == 64 - 8 and Tok().batch_decode([ids])[0].endswith("x|y|")


def test_pattern_verdicts_and_the_unparsed_ones_scoring_0():
    j = judge(pattern=r"Score: (\d)", answers=["Score: 1", "no idea", "Score: 0"])
    rewards, unparsed = j.score([{"response": str(i)} for i in range(3)])
    assert rewards == [1.0, 0.0, 0.0] and unparsed == 1 and j.total_unparsed == 1


def test_requests_that_arrive_together_are_scored_in_one_engine_call():
    release, calls = threading.Event(), []

    class Slow:
        def score(self, items):
            calls.append(len(items))
            release.wait(10)
            return [float(it["i"]) for it in items], 0

    b = Batcher(Slow())
    first = b.submit([{"i": 0}])
    while not calls:  # the engine thread is busy with the first request
        pass
    rest = [b.submit([{"i": i}, {"i": i + 10}]) for i in (1, 2, 3)]
    release.set()
    assert first.result(10) == [0.0]
    assert [f.result(10) for f in rest] == [[1.0, 11.0], [2.0, 12.0], [3.0, 13.0]]
    assert calls == [1, 6]


@pytest.fixture
def judge_server():
    j = judge()
    batcher = Batcher(j)
    server = reward_server(lambda items: batcher.submit(items).result())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield j, f"http://127.0.0.1:{server.server_address[1]}/judge"
    server.shutdown()
    server.server_close()


def test_the_run_scores_the_judge_through_the_remote_reward_client(judge_server):
    j, url = judge_server
    cfg = client_config(RewardConfig(name="judge:/m", judge_timeout_s=42.0, batch_size=2), url)
    assert cfg.name == url and cfg.timeout_s == 42.0
    with build_reward(cfg) as fn:  # probes the server with an empty batch first
        prompts, responses = [f"p{i}" for i in range(5)], [f"r{i}" for i in range(5)]
        rewards, info = fn(prompts, responses, ["a"] * 5)
    want = [j.score([{"prompt": p, "response": r}])[0][0] for p, r in zip(prompts, responses)]
    assert rewards == pytest.approx(want) and info["errors"] == 0


def test_a_bad_request_is_400_and_names_what_the_judge_expects(judge_server):
    import http.client

    _, url = judge_server
    conn = http.client.HTTPConnection(*url.split("/")[2].split(":"))
    conn.request("POST", "/judge", body=json.dumps({"item": []}))
    resp = conn.getresponse()
    assert resp.status == 400 and b'expected {\\"items\\"' in resp.read()


def _spec(tmp_path, **kw):
    (tmp_path / "config.json").write_text("{}")
    return JudgeSpec.of(RewardConfig(name=f"judge:{tmp_path}", **kw))


def test_a_usable_judge_passes_the_checks(tmp_path):
    _spec(tmp_path).check()
    _spec(tmp_path, judge_pattern=r"Score: (\d)").check()


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"judge_template": "{prompt}?"}, r"judge_template has no \{response\}"),
        ({"judge_pattern": "("}, "judge_pattern='\\(' is not a regex"),
        ({"judge_pattern": "Score"}, "has no group"),
        ({"judge_values": [1.0]}, "must be as long as each other"),
    ],
)
def test_bad_judge_settings_are_one_line_before_anything_starts(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        _spec(tmp_path, **kw).check()


def test_check_reward_refuses_a_judge_without_a_model_and_a_format_weight(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        check_reward(RewardConfig(name=f"judge:{tmp_path}/none"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="format_weight=0.5 has no format check"):
        check_reward(RewardConfig(name=f"judge:{tmp_path}", format_weight=0.5))


def test_bad_judge_numbers_are_refused_at_load():
    with pytest.raises(ConfigError, match="judge_gpu_memory_utilization=1.5 must be in"):
        load_config(None, ["reward.judge_gpu_memory_utilization=1.5"])
    with pytest.raises(ConfigError, match="reward.judge_max_tokens"):
        load_config(None, ["reward.judge_max_tokens=0"])
