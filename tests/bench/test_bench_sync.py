"""``megatron-grpo bench sync`` end to end on the tiny model (figures printed, not asserted)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megatron_grpo.cli.main import main
from tests.nccl_rules import ENV as NCCL_RULES_ENV


def test_bench_sync_rejects_bad_arguments(capsys) -> None:
    assert main(["bench", "sync", "--train-tp", "0", "--sink", "null"]) == 2
    assert "--train-tp=0 must be >= 1" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "argv",
    [
        # transfer only, 2 ranks: TP 2 trainer -> two TP 1 destinations, several buckets
        ["--train-tp", "2", "--rollout-tp", "1", "--sink", "null", "--bucket-mb", "0.1,8"],
        # real colocated vLLM engine: checksums and logprob parity
        ["--train-tp", "1", "--rollout-tp", "1", "--sink", "vllm"],
        # the transfer-only case again, every rank under NCCL's rules emulated over gloo
        # (tests/nccl_rules.py, installed at start-up by tests/nccl_rules_site)
        ["--train-tp", "2", "--rollout-tp", "1", "--sink", "null", "--bucket-mb", "0.1"],
        # MoE (docs/moe.md): EP 2 trainer -> one TP 2 engine; each vLLM rank holds all
        # experts, half of them from the other EP rank (the later --model wins)
        ["--model", "tiny-moe", "--train-ep", "2", "--rollout-tp", "2", "--sink", "vllm"],
    ],
    ids=["null-tp2", "vllm-tp1", "null-tp2-nccl-rules", "vllm-moe-ep2"],
)
def test_bench_sync_cli_writes_verified_json(
    tmp_path: Path, argv: list[str], capsys, request, monkeypatch
) -> None:
    if request.node.callspec.id.endswith("nccl-rules"):
        site = Path(__file__).parents[1] / "nccl_rules_site"
        monkeypatch.setenv(
            "PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
        )
        monkeypatch.setenv(NCCL_RULES_ENV, "1")
    out = tmp_path / "sync.json"
    rc = main(["bench", "sync", "--model", "tiny", "--repeats", "2", "--cache-dir",
               str(tmp_path), "--json", str(out), *argv])  # fmt: skip
    printed = capsys.readouterr().out
    print(printed)  # the figures, for -s runs
    res = json.loads(out.read_text())
    assert rc == 0 and res["verified"] is True, res["checks"]
    for key in ("minimal_bytes", "direct", "baseline", "raw", "verified"):
        assert key in res
    assert res["direct"]["bytes"] == res["minimal_bytes"]
    assert res["baseline"]["bytes"] > res["minimal_bytes"]
    assert res["direct"]["seconds"] > 0 and res["baseline"]["seconds"] > 0
    assert res["raw"]["seconds"] > 0
    assert "direct/raw" in printed
