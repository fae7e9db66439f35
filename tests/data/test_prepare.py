"""Issue 47 item 8: ``megatron-grpo data`` turns GSM8K / MATH / DeepScaleR rows in the hub's
column layout (a local file here: no network) into the JSONL the shipped configs read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_grpo.cli.main import main
from megatron_grpo.config import load_config
from megatron_grpo.data.prompts import _read_rows, _source_rows

REPO = Path(__file__).resolve().parents[2]

GSM8K = [  # openai/gsm8k "main": question, answer (the solution, gold after ####)
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A box holds 1,200 pens; 200 are sold.", "answer": "1200-200=1000\n#### 1,000"},
]
MATH = [  # MATH-lighteval: problem, level, solution, type
    {"problem": "What is $1+1$?", "level": "Level 1", "solution": "It is $\\boxed{2}$.",
     "type": "Prealgebra"},
]  # fmt: skip


def _rows(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_gsm8k_jsonl_to_the_configs_layout(tmp_path, capsys):
    src = tmp_path / "gsm8k.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    out = tmp_path / "data" / "gsm8k" / "train.jsonl"
    assert main(["data", "gsm8k", "--input", str(src), "--out", str(out)]) == 0
    assert "2 rows" in capsys.readouterr().out
    assert _rows(out) == [
        {"question": GSM8K[0]["question"], "answer": "7"},
        {"question": GSM8K[1]["question"], "answer": "1000"},
    ]
    # the shipped GSM8K config reads it as it is
    cfg = load_config(str(REPO / "configs" / "qwen2.5-0.5b-gsm8k.yaml"), [f"data.source={out}"])
    rows, p_key, a_key = _source_rows(cfg.data)
    assert [(r[p_key], r[a_key]) for r in rows] == [(GSM8K[0]["question"], "7"),
                                                     (GSM8K[1]["question"], "1000")]  # fmt: skip


def test_math_parquet_and_refusals(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_pylist(MATH), src)
    out = tmp_path / "math.jsonl"
    assert main(["data", "math", "--input", str(src), "--out", str(out)]) == 0
    assert _rows(out) == [{"problem": "What is $1+1$?", "answer": "It is $\\boxed{2}$."}]

    with pytest.raises(SystemExit) as e:  # exists: refused, not overwritten
        main(["data", "math", "--input", str(src), "--out", str(out)])
    assert e.value.code == 2 and "already exists" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # another layout: the row and the columns named
        main(["data", "deepscaler", "--input", str(src), "--out", str(tmp_path / "d.jsonl")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "row 0 has" in err and "'answer'" in err
    assert not (tmp_path / "d.jsonl").exists() and not (tmp_path / "d.jsonl.tmp").exists()


def test_missing_data_file_names_hub_datasets_and_the_data_command(tmp_path):
    cfg = load_config(None, [f"data.source={tmp_path / 'nope.jsonl'}", "reward.name=gsm8k"])
    with pytest.raises(FileNotFoundError) as e:
        _read_rows(cfg.data)
    assert "Hugging Face hub dataset" in str(e.value) and "megatron-grpo data" in str(e.value)


def test_the_hub_path_reads_through_datasets(tmp_path, monkeypatch, capsys):
    """Without --input, the rows come from ``datasets.load_dataset(hub, config, split=)``:
    here the real library over a local dataset repository (a directory of split files, as a
    hub repo is) in the preset's place, so no network; --split and --limit are honoured."""
    import dataclasses

    from megatron_grpo.data import prepare

    repo = tmp_path / "gsm8k_repo"
    repo.mkdir()
    (repo / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    (repo / "test.jsonl").write_text(json.dumps(GSM8K[1]) + "\n")
    local = dataclasses.replace(prepare.PRESETS["gsm8k"], hub=str(repo), hub_config=None)
    monkeypatch.setitem(prepare.PRESETS, "gsm8k", local)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # its cache, not the user's
    out = tmp_path / "test.jsonl"
    assert main(["data", "gsm8k", "--split", "test", "--out", str(out)]) == 0
    assert _rows(out) == [{"question": GSM8K[1]["question"], "answer": "1000"}]
    out = tmp_path / "train.jsonl"
    assert main(["data", "gsm8k", "--limit", "1", "--out", str(out)]) == 0
    assert _rows(out) == [{"question": GSM8K[0]["question"], "answer": "7"}]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_hub_unreachable_is_one_line(tmp_path):
    """Offline (no network here; HF_HUB_OFFLINE=1 makes it certain and quick), the hub path
    is one line that says what to do instead, and writes nothing."""
    import os
    import subprocess
    import sys

    out = tmp_path / "gsm8k.jsonl"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    r = subprocess.run([sys.executable, "-m", "megatron_grpo.cli.main", "data", "gsm8k",
                        "--out", str(out)], env=env, capture_output=True, text=True,
                       timeout=110)  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: loading openai/gsm8k (split train) from the hub failed ("
    ), r.stderr
    assert lines[0].endswith("download it on an online machine and pass --input FILE."), lines
    assert not out.exists()
