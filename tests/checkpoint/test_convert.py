"""Checkpoint conversion: HF -> mcore -> HF round trips (bitwise), loading the converted
checkpoint at other TP/PP layouts, and clear errors with no partial output.

The conversions run in one child process (``_battery``), because building megatron models
applies the CPU platform layer process-wide; the error checks that fail before any model is
built run in the test process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoints_tools.hf_to_mcore import hf_to_mcore
from megatron_grpo.checkpoint.conversion import ConvertError, atomic_output_dir
from megatron_grpo.layouts.io import CheckpointError
from megatron_grpo.models.spec import UnsupportedModelError
from megatron_grpo.models.tiny import build_hf_model

REPO = Path(__file__).resolve().parents[2]

# name -> build_hf_model overrides; vocab = 91 + extra_vocab (not a multiple of 64 or 128)
MODELS = {
    "qwen2-tied-gqa": dict(extra_vocab=5),
    "llama-untied-kv1": dict(
        architecture="LlamaForCausalLM",
        num_key_value_heads=1,
        tie_word_embeddings=False,
        extra_vocab=3,
    ),
    "qwen3-untied-gqa": dict(architecture="Qwen3ForCausalLM", tie_word_embeddings=False),
    "qwen3-tied-bf16": dict(
        architecture="Qwen3ForCausalLM", dtype="bfloat16", num_key_value_heads=4
    ),
}


def _read_hf(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _battery(root: str) -> None:
    """Run in a child process: every conversion, through the CLI entry point."""
    from megatron_grpo.cli.main import main

    def convert(*argv) -> int:
        return main(["convert", *map(str, argv)])

    root = Path(root)
    for name, kw in MODELS.items():
        hf, ckpt = root / name / "hf", root / name / "ckpt"
        build_hf_model(hf, "tiny", **kw)
        assert convert("hf-to-mcore", "--hf", hf, "--out", ckpt) == 0
        # small shards so the index path is exercised
        back, shard_gb = root / name / "back", 300_000 / 1024**3
        assert (
            convert("mcore-to-hf", "--ckpt", ckpt, "--out", back, "--max-shard-gb", shard_gb) == 0
        )
        assert convert("inspect", "--ckpt", ckpt) == 0
    # explicit downcast, and the external --hf-config path
    src = root / "qwen3-untied-gqa"
    argv = ["mcore-to-hf", "--ckpt", src / "ckpt", "--out", src / "bf16", "--dtype", "bfloat16"]
    assert convert(*argv, "--hf-config", src / "hf") == 0


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    code = f"from tests.checkpoint.test_convert import _battery; _battery({str(root)!r})"
    # subprocess.run waits for the child and kills it on timeout
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=540
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root, proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(MODELS))
def test_round_trip_bitwise(converted, name):
    root, _ = converted
    a, b = _read_hf(root / name / "hf"), _read_hf(root / name / "back")
    assert list(sorted(a)) == list(sorted(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert (root / name / "back" / "model.safetensors.index.json").is_file()
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (root / name / "back" / f).is_file(), f
    cfg_a = json.loads((root / name / "hf" / "config.json").read_text())
    cfg_b = json.loads((root / name / "back" / "config.json").read_text())
    assert cfg_a == cfg_b
    info = json.loads((root / name / "ckpt" / "megatron_grpo_checkpoint.json").read_text())
    assert info["dtype"] == ("bfloat16" if "bf16" in name else "float32")
    assert info["spec"]["vocab_size"] % 64 != 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_explicit_downcast_and_inspect(converted):
    root, stdout = converted
    a, b = _read_hf(root / "qwen3-untied-gqa" / "hf"), _read_hf(root / "qwen3-untied-gqa" / "bf16")
    assert all(t.dtype == torch.bfloat16 for t in b.values())
    assert all(torch.equal(a[k].to(torch.bfloat16), b[k]) for k in a)
    cfg = json.loads((root / "qwen3-untied-gqa" / "bf16" / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    assert "decoder.layers.self_attention.q_layernorm.weight" in stdout


def _load_at_layout(rank, world_size, tp, pp, ckpt, hf_dir):
    """Load the converted checkpoint at (tp, pp) and gather it back to HF tensors."""
    from megatron.core import dist_checkpointing

    from megatron_grpo.config.schema import ModelConfig, ParallelConfig
    from megatron_grpo.distributed import distributed_context
    from megatron_grpo.layouts import gather_hf_state_dict
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.policy.model_builder import build_model

    spec = load_spec(hf_dir)
    with distributed_context(ParallelConfig(tp=tp, pp=pp), spec) as ctx:
        chunks = build_model(spec, ctx, ModelConfig())
        state = {"model": chunks[0].sharded_state_dict()}
        loaded = dist_checkpointing.load(state, ckpt)
        chunks[0].load_state_dict(loaded["model"], strict=True)
        got = gather_hf_state_dict(chunks, spec, ctx, dst_rank=0)
        if rank == 0:
            want = _read_hf(Path(hf_dir))
            assert sorted(got) == sorted(want)
            bad = [k for k in want if not torch.equal(got[k], want[k])]
            assert not bad, bad[:5]
        return True


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["llama-untied-kv1", "qwen2-tied-gqa"])
def test_converted_checkpoint_loads_at_tp2_pp2(converted, name):
    """dist_checkpointing reshards: the TP=PP=1 checkpoint loads at TP=2, PP=2 (vocab
    padding 128 -> 256 differs; the embedding's allow_shape_mismatch covers it)."""
    from tests.dist_utils import run_distributed

    root, _ = converted
    run_distributed(
        _load_at_layout, 4, 2, 2, str(root / name / "ckpt"), str(root / name / "hf"), timeout=400
    )


# --- errors: checked before any model is built, in the test process ---------------------


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return build_hf_model(tmp_path_factory.mktemp("src") / "hf", "tiny", extra_vocab=5)


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_errors_leave_no_output(tiny_hf, tmp_path):
    out = tmp_path / "out"
    # unsupported architecture
    bad = _copy(tiny_hf, tmp_path / "mistral")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="MistralForCausalLM"):
        hf_to_mcore(bad, out)
    # shapes that do not match config.json
    bad = _copy(tiny_hf, tmp_path / "shape")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"mlp\.gate_proj\.weight has shape"):
        hf_to_mcore(bad, out)
    # truncated weights file
    bad = _copy(tiny_hf, tmp_path / "trunc")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors.*truncated"):
        hf_to_mcore(bad, out)
    # an index naming a shard file that is missing
    bad = _copy(tiny_hf, tmp_path / "missing")
    from safetensors import safe_open

    with safe_open(str(bad / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    (bad / "model.safetensors").rename(bad / "model-00001-of-00002.safetensors")
    wm = {k: "model-00001-of-00002.safetensors" for k in keys}
    wm[keys[-1]] = "model-00002-of-00002.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        hf_to_mcore(bad, out)
    assert not out.exists()
    assert not any(p.name.startswith(".out") for p in tmp_path.iterdir())
    # an existing output directory is never overwritten
    out.mkdir()
    with pytest.raises(ConvertError, match="already exists"):
        hf_to_mcore(tiny_hf, out)


def test_atomic_output_dir_removes_partial_output(tmp_path):
    out = tmp_path / "o"
    with pytest.raises(RuntimeError), atomic_output_dir(out) as tmp:
        (tmp / "partial").write_text("x")
        raise RuntimeError("boom")
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_truncated_shard_is_one_line_in_inspect_and_mcore_to_hf(tiny_hf, tmp_path):
    from tests.helpers.commands import cli

    ckpt = tmp_path / "ckpt"
    rc, out = cli("convert", "hf-to-mcore", "--hf", str(tiny_hf), "--out", str(ckpt))
    assert rc == 0, out[-2000:]
    shard = sorted(ckpt.glob("*.distcp"))[0]
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    line = f"error: {shard} is truncated ({size // 2} of at least"
    for cmd in (["inspect"], ["mcore-to-hf", "--out", str(tmp_path / "hf")]):
        rc, out = cli("convert", *cmd, "--ckpt", str(ckpt))
        errors = [x for x in out.splitlines() if x.startswith("error:")]
        assert rc == 2 and len(errors) == 1 and errors[0].startswith(line), out
        assert "Traceback" not in out
    assert not (tmp_path / "hf").exists()
