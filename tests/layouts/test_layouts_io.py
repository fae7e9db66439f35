"""load_hf_into_megatron / gather_hf_state_dict in spawned gloo processes.

The model chunks here are stand-ins with exactly the Megatron parameter names and shapes
the layouts describe (random-filled), so the streaming load and the point-to-point gather
are tested without building megatron-core models; tests/checkpoint/test_convert.py exercises the same
functions on real GPTModels.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_grpo.layouts import hf
from megatron_grpo.layouts import megatron as mg
from megatron_grpo.layouts.io import (
    CheckpointError,
    HFCheckpointReader,
    RankInfo,
    gather_hf_state_dict,
    load_hf_into_megatron,
)
from megatron_grpo.layouts.pieces import assemble, reader_from_dict
from megatron_grpo.models.spec import load_spec
from megatron_grpo.models.tiny import build_hf_model


def fake_chunk(spec, ml, pp_rank, vp, tp_rank, wrap=True) -> torch.nn.Module:
    """An nn.Module whose named_parameters are the chunk's Megatron names (DDP-style
    ``module.`` prefix when wrap)."""
    root = torch.nn.Module()
    for name in mg.chunk_names(spec, ml, pp_rank, vp):
        shape = mg.shard(spec, ml, name, pp_rank, vp, tp_rank).shape
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.randn(shape)))
    if wrap:
        outer = torch.nn.Module()
        outer.add_module("module", root)
        return outer
    return root


def reshard(src: Path, dst: Path, parts: int = 3) -> None:
    """Rewrite model.safetensors as ``parts`` shard files + model.safetensors.index.json."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    names = list(tensors)
    weight_map = {}
    for i in range(parts):
        fname = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {n: tensors[n].contiguous() for n in names[i::parts]}
        save_file(chunk, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in chunk})
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {
        "qwen2-tied-kv2": build_hf_model(root / "a", "tiny", extra_vocab=5, num_hidden_layers=4),
        "llama-untied-kv1": build_hf_model(
            root / "b",
            "tiny",
            extra_vocab=3,
            num_hidden_layers=4,
            architecture="LlamaForCausalLM",
            num_key_value_heads=1,
            tie_word_embeddings=False,
        ),
        "qwen3-untied-kv2": build_hf_model(
            root / "c",
            "tiny",
            architecture="Qwen3ForCausalLM",
            tie_word_embeddings=False,
            num_hidden_layers=4,
        ),
    }
    reshard(out["llama-untied-kv1"], root / "b_sharded")
    out["llama-untied-kv1-sharded"] = root / "b_sharded"
    return out


def _worker(rank, world, port, hf_dir, tp, pp, vpp, norm_style):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        spec = load_spec(hf_dir)
        dp = world // (tp * pp)
        # megatron's default order tp-cp-ep-dp-pp
        tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
        ml = mg.MegatronLayout(tp, pp, vpp, dp, norm_style=norm_style)
        ctx = RankInfo(ml, tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank)
        chunks = [fake_chunk(spec, ml, pp_rank, v, tp_rank) for v in range(vpp)]
        load_hf_into_megatron(chunks, hf_dir, spec, ctx)
        from safetensors.torch import load_file

        if (Path(hf_dir) / "model.safetensors").is_file():
            full = load_file(str(Path(hf_dir) / "model.safetensors"))
        else:
            full = {}
            for f in sorted(Path(hf_dir).glob("model-*.safetensors")):
                full.update(load_file(str(f)))
        read = reader_from_dict(full)
        for v, c in enumerate(chunks):
            for n, p in c.named_parameters():
                lay = mg.shard(spec, ml, n, pp_rank, v, tp_rank)
                assert torch.equal(p.data, assemble(lay, read, torch.float32)), n
        for dst in {0, world - 1}:
            got = gather_hf_state_dict(chunks, spec, ctx, dst_rank=dst)
            if rank == dst:
                want = {n: full[n] for n in hf.hf_shapes(spec)}
                assert list(got) == list(want), (list(got)[:5], list(want)[:5])
                for n, t in want.items():
                    assert torch.equal(got[n], t), n
            else:
                assert got == {}
    finally:
        dist.destroy_process_group()


def _spawn(world, *args):
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # mp.spawn joins every child and terminates the others when one fails.
    mp.spawn(
        _worker,
        args=(world, port, *[str(a) if isinstance(a, Path) else a for a in args]),
        nprocs=world,
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "model,world,tp,pp,vpp,norm",
    [
        ("qwen2-tied-kv2", 1, 1, 1, 1, "local"),
        ("qwen2-tied-kv2", 4, 2, 2, 1, "te"),
        ("qwen2-tied-kv2", 4, 1, 2, 2, "local"),
        ("llama-untied-kv1-sharded", 2, 2, 1, 1, "local"),
        ("qwen3-untied-kv2", 4, 2, 2, 1, "local"),
        ("qwen3-untied-kv2", 4, 4, 1, 1, "te"),
    ],
)
def test_load_and_gather(hf_models, model, world, tp, pp, vpp, norm):
    _spawn(world, hf_models[model], tp, pp, vpp, norm)


def test_reader_refuses_missing_truncated_and_mismatched_checkpoints(hf_models, tmp_path):
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        HFCheckpointReader(tmp_path)
    bad = tmp_path / "trunc"
    bad.mkdir()
    src = Path(hf_models["qwen2-tied-kv2"]) / "model.safetensors"
    (bad / "model.safetensors").write_bytes(src.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="truncated"):
        HFCheckpointReader(bad)
    # the right file under the wrong config: names the tensor and the shapes
    spec = load_spec(hf_models["qwen3-untied-kv2"])
    with pytest.raises(CheckpointError, match="q_norm|missing|shape"):
        HFCheckpointReader(hf_models["qwen2-tied-kv2"]).check_shapes(spec)


def test_load_rejects_unknown_parameter(hf_models):
    spec = load_spec(hf_models["qwen2-tied-kv2"])
    ml = mg.MegatronLayout()
    chunk = fake_chunk(spec, ml, 0, 0, 0)
    chunk.module.register_parameter("extra_weight", torch.nn.Parameter(torch.zeros(2)))
    with pytest.raises(mg.UnknownParameterError, match="extra_weight"):
        load_hf_into_megatron([chunk], hf_models["qwen2-tied-kv2"], spec, RankInfo())
