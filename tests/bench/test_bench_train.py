"""``megatron-grpo bench train`` (megatron_grpo/bench/train*.py): the tiny preset end to end on
CPU with vLLM, ``datasets`` and ``math-verify`` made unimportable (the GPU machine has none of
them), the JSON's figures checked against each other and against the batch, and both sides'
log-probs and first step compared on the same weights in fp32."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_grpo.bench.train.batch import make_batch, micro_batches, one_sequence
from megatron_grpo.bench.train.measure import (
    PEAK_BF16_TFLOPS,
    flop_params,
    known_peak_tflops,
    largest_trainable,
)
from megatron_grpo.cli.main import main
from megatron_grpo.models.shapes import preset_spec

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("vllm", "datasets", "math_verify")
ARGS = dict(rows=6, prompt_len=16, min_len=4, max_len=40, micro_batch_size=2, seed=3)

# Runs the command in a fresh interpreter where the BLOCKED packages look uninstalled: an
# import raises ModuleNotFoundError and importlib.util.find_spec answers None (what
# transformers' availability checks call), then lists any of them that got imported anyway.
RUNNER = textwrap.dedent(
    """
    import importlib.abc, importlib.util, json, sys
    BLOCKED = {blocked!r}

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
            return None

    _find_spec = importlib.util.find_spec
    importlib.util.find_spec = lambda name, package=None: (
        None if name.split(".")[0] in BLOCKED else _find_spec(name, package))
    sys.meta_path.insert(0, Block())
    from megatron_grpo.cli.main import main
    rc = main(sys.argv[1:])
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    print("BLOCKED_LOADED=" + json.dumps(loaded))
    sys.exit(rc)
    """
)


def _argv(json_out: Path) -> list[str]:
    # --search on with the smallest cap: one 1024-token train step per side (CPU has no OOM
    # to find; the doubling itself is tested below).
    argv = "bench train --preset tiny --device cpu --steps 2 --warmup 1 --search on".split()
    argv += ["--search-cap", "1024", "--json", str(json_out)]
    for k, v in ARGS.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_train_tiny_on_cpu_without_vllm(tmp_path: Path) -> None:
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER.format(blocked=BLOCKED))
    out = tmp_path / "train.json"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
    )
    proc = subprocess.run(
        [sys.executable, str(runner), *_argv(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=170,
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.split("BLOCKED_LOADED=")[1].splitlines()[0])
    assert loaded == [], f"bench train imported {loaded}"
    for line in ("project/hf", "project/hf-packed", "log-prob parity", "hf-packed vs hf",
                 "largest sequence that trains: project 1,024"):  # fmt: skip
        assert line in proc.stdout

    res = json.loads(out.read_text())
    spec = preset_spec("tiny")
    batch = make_batch(
        spec.vocab_size, **{k: v for k, v in ARGS.items() if k != "micro_batch_size"}
    )
    b = res["batch"]
    assert b["useful_tokens"] == int(batch.attention_mask.sum())
    assert b["response_tokens"] == int(batch.loss_mask.sum())
    assert b["seq_len"] == batch.input_ids.shape[1]
    mbs = micro_batches(batch, ARGS["micro_batch_size"])
    assert b["padded_tokens"] == sum(len(mb.input_ids) * n for _, n, mb in mbs)
    assert res["device"] == "cpu" and res["dtype"] == "float32" and res["search"] is True
    assert res["flop_params"] == flop_params(spec)
    assert res["flops_per_token"] == {
        "train": 6 * flop_params(spec),
        "logprob": 2 * flop_params(spec),
    }
    assert res["attention_flops_included"] is False

    sides = res["sides"]
    assert list(sides) == ["project", "hf", "hf-packed"]
    assert b["hf_packed_micro_batch_tokens"] == b["project_micro_batch_tokens"]
    assert sides["hf-packed"]["liger"] is False  # CPU: Liger-Kernel is Triton
    for name, side in sides.items():
        assert side["num_parameters"] == spec.num_parameters, name
        for phase in ("train", "logprob"):
            p = side[phase]
            assert len(p["seconds"]) == 2 and min(p["seconds"]) > 0
            assert min(p["seconds"]) <= p["median_s"] <= max(p["seconds"])
            assert p["useful_tokens"] == b["useful_tokens"]
            assert p["useful_tokens_per_s"] == pytest.approx(b["useful_tokens"] / p["median_s"])
            assert p["mfu"] is None and p["peak_gib"] is None  # CPU: no peak, no device memory
        tried = [{"length": 1024, "ok": True, "peak_gib": None}]
        assert side["largest_trainable"] == {"largest": 1024, "cap": 1024, "tried": tried}
    for phase in ("train", "logprob"):
        rate = {n: s[phase]["useful_tokens_per_s"] for n, s in sides.items()}
        assert res["ratio"][phase] == pytest.approx(rate["project"] / rate["hf"])
        for other in ("hf", "hf-packed"):
            assert res["ratio"][other][phase] == pytest.approx(rate["project"] / rate[other])

    # Same initial weights (the project's, converted by layouts.io): same log-probs in fp32,
    # and the same first loss and gradient norm on the same GRPO batch.
    par = res["logprob_parity"]
    assert par["tokens"] == b["useful_tokens"] - b["rows"]  # position 0 has no prediction
    assert par["mean_logp"] < -1.0  # a real log-prob pass (a random model: ~ -log(vocab))
    assert par["max_abs_diff"] <= 1e-5, par
    # the HF model with padding removed (packed rows, positions restarting per document,
    # the project's varlen attention) scores what the padded one does
    assert par["hf-packed_vs_hf"]["max_abs_diff"] <= 1e-5, par
    assert par["hf-packed_vs_hf"]["tokens"] == par["tokens"]
    first = {n: s["first_step"] for n, s in sides.items()}
    assert first["hf-packed"]["loss"] == pytest.approx(first["hf"]["loss"], rel=1e-5, abs=1e-7)
    assert first["hf-packed"]["grad_norm"] == pytest.approx(first["hf"]["grad_norm"], rel=1e-5)
    assert first["project"]["loss"] == pytest.approx(first["hf"]["loss"], rel=1e-5, abs=1e-7)
    assert first["project"]["grad_norm"] == pytest.approx(first["hf"]["grad_norm"], rel=1e-5)
    assert first["project"]["grad_norm"] > 0


def test_largest_trainable_doubles_until_oom_and_frees_after_every_try() -> None:
    lengths, freed = [], []

    def try_length(n: int) -> float:
        lengths.append(n)
        if n >= 8192:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return n / 1024

    res = largest_trainable(try_length, cap=32768, free=lambda: freed.append(len(lengths)))
    assert lengths == [1024, 2048, 4096, 8192]
    assert freed == [1, 2, 3, 4]
    assert res["largest"] == 4096
    assert [t["ok"] for t in res["tried"]] == [True, True, True, False]
    assert res["tried"][2]["peak_gib"] == 4.0

    res = largest_trainable(lambda n: None, cap=3000, free=lambda: None)
    assert res["largest"] == 2048 and len(res["tried"]) == 2  # stops at the cap, no failure


def test_batch_is_right_padded_and_lengths_stay_in_range() -> None:
    batch = make_batch(64, rows=16, prompt_len=32, min_len=8, max_len=48, seed=0)
    attn, resp = batch.attention_mask, batch.loss_mask
    lengths = attn.sum(1)
    assert (attn == (torch.arange(attn.shape[1]) < lengths[:, None]).float()).all()
    prompts = lengths - resp.sum(1)
    assert prompts.min() >= 28 and prompts.max() <= 32
    assert resp.sum(1).min() >= 8 and resp.sum(1).max() <= 48
    assert batch.input_ids[attn == 1].min() >= 3 and (batch.input_ids[attn == 0] == 0).all()
    for rows, n, mb in micro_batches(batch, 3):
        assert mb.input_ids.shape[1] == n == int(lengths[rows].max())
    one = one_sequence(64, 1024, prompt_len=256, seed=0)  # what the length search trains
    assert one.input_ids.shape == (1, 1024) and int(one.attention_mask.sum()) == 1024
    assert int(one.loss_mask.sum()) == 1024 - 256
    # seeded: the same arguments give the same batch
    assert torch.equal(make_batch(64, 16, 32, 8, 48, 0).input_ids, batch.input_ids)


def test_flop_params_and_the_device_peak_table() -> None:
    tied, untied = preset_spec("Qwen2.5-0.5B"), preset_spec("Qwen2.5-7B")
    assert flop_params(tied) == tied.num_parameters  # the tied embedding is the output layer
    assert flop_params(untied) == untied.num_parameters - untied.vocab_size * untied.hidden_size
    assert known_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert known_peak_tflops("NVIDIA H200") == 989.0
    assert known_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert known_peak_tflops("Some Other Accelerator") is None
    assert all(v > 0 for _, v in PEAK_BF16_TFLOPS)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--min-len", "100", "--max-len", "50"], "--min-len=100 > --max-len=50"),
        (["--rows", "0"], "--rows=0 must be >= 1"),
        (["--preset", "nope"], "--preset 'nope' is not a preset"),
        (["--search-cap", "10"], "--search-cap=10 must be >= 1024"),
        (["--sides", "hf,project"], "--sides='hf,project': a comma list of"),
        (["--sides", "project,hf,hf"], "--sides='project,hf,hf': a comma list of"),
    ],
)
def test_bench_train_rejects_bad_arguments(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "train", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_hf_sides_fuse_the_experts_as_transformers_holds_them() -> None:
    from megatron_grpo.bench.train.sides import _fuse_experts
    from megatron_grpo.models.prepare import unfuse_experts

    fused = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.arange(3 * 8 * 5.0).view(3, 8, 5),
        "model.layers.0.mlp.experts.down_proj": torch.arange(3 * 5 * 4.0).view(3, 5, 4),
        "model.layers.0.mlp.gate.weight": torch.ones(3, 5),
    }
    back = _fuse_experts(unfuse_experts(fused))
    assert back.keys() == fused.keys()
    assert all(torch.equal(back[k], t) for k, t in fused.items())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_train_moe_packed_beside_padded(tmp_path: Path) -> None:
    """The tiny MoE preset: the project packed and padded (``project-padded``) and the HF
    model side by side, all from the same initial weights: the same first step and log-probs."""
    out = tmp_path / "moe.json"
    argv = ["bench", "train", "--preset", "tiny-moe", "--device", "cpu", "--steps", "1",
            "--warmup", "0", "--search", "off", "--sides", "project,project-padded,hf",
            "--json", str(out)]  # fmt: skip
    for k, v in ARGS.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "megatron_grpo.cli.main", *argv],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=170)  # fmt: skip
    print(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "project/project-padded" in proc.stdout
    res = json.loads(out.read_text())
    sides = res["sides"]
    assert list(sides) == ["project", "project-padded", "hf"]
    assert res["batch"]["project_micro_batch_tokens"] is not None  # the project side packs
    for phase in ("train", "logprob"):
        rate = {n: s[phase]["useful_tokens_per_s"] for n, s in sides.items()}
        assert res["ratio"]["project-padded"][phase] == pytest.approx(
            rate["project"] / rate["project-padded"]
        )
    first = {n: s["first_step"] for n, s in sides.items()}
    for other in ("project-padded", "hf"):
        assert first[other]["loss"] == pytest.approx(first["project"]["loss"], rel=1e-5, abs=1e-7)
        assert first[other]["grad_norm"] == pytest.approx(first["project"]["grad_norm"], rel=1e-5)
    assert res["logprob_parity"]["max_abs_diff"] <= 1e-5  # project vs the HF Qwen3-MoE
