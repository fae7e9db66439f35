"""Prompt sources: file formats, malformed rows, templates, synthetic tasks, resumable order."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from megatron_grpo.config.schema import DataConfig
from megatron_grpo.data import build_prompt_source
from megatron_grpo.rewards.synthetic import synthetic_example

FIXTURES = Path(__file__).parents[1] / "fixtures"
GSM8K = str(FIXTURES / "gsm8k_tiny.jsonl")
MATH = str(FIXTURES / "math_tiny.jsonl")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from megatron_grpo.models.tiny import build_char_tokenizer

    return build_char_tokenizer(tmp_path_factory.mktemp("tok"))


def test_gsm8k_jsonl_skips_and_counts_malformed_rows(caplog):
    with caplog.at_level(logging.WARNING):
        src = build_prompt_source(DataConfig(source=GSM8K), None)
    r = src.report
    # rows 3 (no answer), 4 (question is an int), 5 (blank), 7 (broken JSON) are skipped
    assert (r.total, r.kept) == (10, 6)
    assert r.skipped == {"missing_key": 1, "not_string": 1, "empty": 1, "bad_json": 1}
    assert r.first_rows == {"missing_key": [3], "not_string": [4], "empty": [5], "bad_json": [7]}
    assert "kept 6 of 10" in caplog.text and "missing_key=1 (first rows [3])" in caplog.text
    assert sorted(p.meta["row"] for p in src.next_batch(6)) == [0, 1, 2, 6, 8, 9]


def test_strict_fails_naming_the_row():
    with pytest.raises(ValueError, match=r"row 3 \(0-based\): missing_key.*data.strict=false"):
        build_prompt_source(DataConfig(source=GSM8K, strict=True), None)


def test_math_format_keys_and_numeric_answer():
    cfg = DataConfig(source=MATH, prompt_key="problem", answer_key="answer")
    src = build_prompt_source(cfg, None)
    assert src.report.skipped == {"empty": 1, "not_string": 1}  # "" problem, null answer
    answers = {p.meta["row"]: p.answer for p in src.next_batch(4)}
    assert answers == {0: "\\frac{3}{4}", 1: "4", 2: "7", 3: "(2,1)"}  # 7 -> "7"


def test_parquet_and_arrow_and_saved_dir(tmp_path):
    import datasets

    rows = [json.loads(line) for line in open(MATH)][:4]
    for r in rows:
        r["answer"] = str(r["answer"])
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "m.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    for source in (tmp_path / "m.parquet", arrow, tmp_path / "saved"):
        cfg = DataConfig(source=str(source), prompt_key="problem", answer_key="answer")
        src = build_prompt_source(cfg, None)
        assert len(src) == 4 and src.report.skipped == {}, source


def test_template_and_tokens(tokenizer):
    cfg = DataConfig(source="synthetic:add", template="Q: {prompt}", synthetic_size=8)
    src = build_prompt_source(cfg, tokenizer)
    p = src.next_batch(1)[0]
    assert p.text.startswith("Q: ") and p.text.endswith("=")
    assert tokenizer.decode(p.prompt_ids) == p.text  # char tokenizer: one id per character
    assert len(p.prompt_ids) == len(p.text)
    chat = build_prompt_source(dataclasses.replace(cfg, template="chat"), tokenizer)
    assert chat.next_batch(1)[0].text.startswith("user: ")
    assert chat.next_batch(1)[0].text.endswith("\nassistant: ")


def test_too_long_prompts_skipped(tokenizer):
    cfg = DataConfig(source=GSM8K, max_prompt_tokens=60)
    src = build_prompt_source(cfg, tokenizer)
    assert src.report.skipped["too_long"] >= 1
    assert all(len(p.prompt_ids) <= 60 for p in src.next_batch(len(src)))
    strict = DataConfig(source="synthetic:add", max_prompt_tokens=3, strict=True)  # "4+7=" is 4
    with pytest.raises(ValueError, match="row 0 .*too_long .*4 tokens > data.max_prompt_tokens=3"):
        build_prompt_source(strict, tokenizer)


def test_template_errors_name_the_fix(tokenizer):
    with pytest.raises(ValueError, match="only \\{prompt\\}"):
        build_prompt_source(DataConfig(template="{question}"), None)
    with pytest.raises(ValueError, match="no \\{prompt\\} placeholder"):
        build_prompt_source(DataConfig(template="static"), None)
    with pytest.raises(ValueError, match="chat template"):
        build_prompt_source(DataConfig(template="chat"), None)
    with pytest.raises(ValueError, match="synthetic:add"):
        build_prompt_source(DataConfig(source="synthetic:nope"), None)
    with pytest.raises(FileNotFoundError, match="fix the path"):
        build_prompt_source(DataConfig(source="/nonexistent/x.jsonl"), None)
    with pytest.raises(ValueError, match="no usable prompt"):
        build_prompt_source(DataConfig(source=GSM8K, prompt_key="nope"), None)


def test_synthetic_source_matches_generator():
    cfg = DataConfig(source="synthetic:reverse", synthetic_size=16, synthetic_difficulty=2)
    src = build_prompt_source(cfg, None)
    got = {p.meta["row"]: (p.text, p.answer) for p in src.next_batch(16)}
    assert got == {i: synthetic_example("reverse", 2, i) for i in range(16)}


def test_shuffle_is_seeded_and_epochs_reshuffle():
    cfg = DataConfig(source="synthetic:add", synthetic_size=10, shuffle_seed=3)
    a = [p.meta["row"] for p in build_prompt_source(cfg, None).next_batch(20)]
    b = [p.meta["row"] for p in build_prompt_source(cfg, None).next_batch(20)]
    c = [
        p.meta["row"]
        for p in build_prompt_source(dataclasses.replace(cfg, shuffle_seed=4), None).next_batch(20)
    ]
    assert a == b and a != c
    assert sorted(a[:10]) == list(range(10)) == sorted(a[10:])  # each epoch is a permutation
    assert a[:10] != a[10:]


def test_resume_sees_exactly_the_same_next_prompts():
    cfg = DataConfig(source=GSM8K, shuffle_seed=11)
    full = build_prompt_source(cfg, None)
    first = full.next_batch(4)
    rest = [p.text for p in full.next_batch(9)]  # crosses into epoch 1 (6 rows)
    part = build_prompt_source(cfg, None)
    assert [p.text for p in part.next_batch(4)] == [p.text for p in first]
    state = json.loads(json.dumps(part.state_dict()))  # survives a checkpoint round-trip
    resumed = build_prompt_source(cfg, None)
    resumed.load_state_dict(state)
    assert [p.text for p in resumed.next_batch(9)] == rest
    assert resumed.state_dict()["epoch"] == 2 and resumed.state_dict()["index"] == 1
    other = build_prompt_source(DataConfig(source="synthetic:add"), None)
    with pytest.raises(ValueError, match="same data.source"):
        other.load_state_dict(state)
    reseeded = build_prompt_source(dataclasses.replace(cfg, shuffle_seed=12), None)
    with pytest.raises(ValueError, match="shuffle_seed=11"):
        reseeded.load_state_dict(state)
