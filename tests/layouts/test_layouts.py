"""Slice algebra of the layouts, without processes.

Full HF tensors are filled with distinct ``arange`` values so any misplaced slice shows.
Megatron and vLLM shards cut by the layouts are compared with reference shards computed
here independently: Megatron's by the documented interleave (attention.py "q1 q2 k1 v1 |
q3 q4 k2 v2", then an even column-parallel split), vLLM's by emulating the narrow logic of
QKVParallelLinear / MergedColumnParallelLinear / RowParallelLinear /
VocabParallelEmbedding ``weight_loader`` in vllm/model_executor/layers/.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_grpo.layouts import hf, intersect, scatter
from megatron_grpo.layouts import megatron as mg
from megatron_grpo.layouts import vllm as vl
from megatron_grpo.layouts.pieces import Piece, assemble, cut, reader_from_dict
from tests.helpers.layouts import arange_hf, make_spec

F64 = torch.float64


# --- independent references ------------------------------------------------------------


def ref_megatron_rank(spec, w, layer, tp, r, vm):
    """Megatron shards of one layer + vocab tensors, by the documented formulas."""
    p = hf.layer_prefix(layer)
    ng, hpg, hn, h = spec.num_kv_heads, spec.heads_per_group, spec.head_dim, spec.hidden_size

    def fused(kind):
        q = w[p + f"self_attn.q_proj.{kind}"].reshape(ng, hpg * hn, -1)
        k = w[p + f"self_attn.k_proj.{kind}"].reshape(ng, hn, -1)
        v = w[p + f"self_attn.v_proj.{kind}"].reshape(ng, hn, -1)
        full = torch.cat([q, k, v], dim=1).reshape(ng * (hpg + 2) * hn, -1)
        return (
            full.chunk(tp, 0)[r].reshape(-1, h)
            if kind == "weight"
            else full.chunk(tp, 0)[r].reshape(-1)
        )

    out = {"qkv": fused("weight")}
    if spec.qkv_bias:
        out["qkv_bias"] = fused("bias")
    gate = w[p + "mlp.gate_proj.weight"].chunk(tp, 0)[r]
    up = w[p + "mlp.up_proj.weight"].chunk(tp, 0)[r]
    out["fc1"] = torch.cat([gate, up])
    out["proj"] = w[p + "self_attn.o_proj.weight"].chunk(tp, 1)[r]
    out["fc2"] = w[p + "mlp.down_proj.weight"].chunk(tp, 1)[r]
    emb = torch.zeros(vm, h, dtype=torch.float64)
    emb[: spec.vocab_size] = w[hf.EMBED]
    out["emb"] = emb.chunk(tp, 0)[r]
    return out


def ref_vllm_rank(spec, w, layer, tp, r):
    """Emulates vLLM's weight_loaders (layers/linear.py, layers/vocab_parallel_embedding.py)."""
    p = hf.layer_prefix(layer)
    hn, h, ng = spec.head_dim, spec.hidden_size, spec.num_kv_heads
    num_heads = spec.num_heads // tp
    if tp >= ng:
        num_kv, replicas = 1, tp // ng
    else:
        num_kv, replicas = ng // tp, 1

    def qkv(kind):
        shape = (
            ((num_heads + 2 * num_kv) * hn, h)
            if kind == "weight"
            else ((num_heads + 2 * num_kv) * hn,)
        )
        param = torch.full(shape, -1.0, dtype=torch.float64)
        for sid in "qkv":
            off = {"q": 0, "k": num_heads * hn, "v": (num_heads + num_kv) * hn}[sid]
            size = num_heads * hn if sid == "q" else num_kv * hn
            shard_rank = r if sid == "q" else r // replicas
            loaded = w[p + f"self_attn.{sid}_proj.{kind}"].narrow(0, shard_rank * size, size)
            param.narrow(0, off, size).copy_(loaded)
        return param

    out = {"qkv": qkv("weight")}
    if spec.qkv_bias:
        out["qkv_bias"] = qkv("bias")
    f = spec.ffn_hidden_size
    gu = torch.full((2 * f // tp, h), -1.0, dtype=torch.float64)
    for i, n in enumerate(("gate_proj", "up_proj")):
        size = f // tp
        gu.narrow(0, i * size, size).copy_(w[p + f"mlp.{n}.weight"].narrow(0, r * size, size))
    out["gate_up"] = gu
    cols = spec.num_heads * hn // tp
    out["o"] = w[p + "self_attn.o_proj.weight"].narrow(1, r * cols, cols)
    out["down"] = w[p + "mlp.down_proj.weight"].narrow(1, r * (f // tp), f // tp)
    vv = (spec.vocab_size + 63) // 64 * 64
    per = vv // tp
    start, end = min(r * per, spec.vocab_size), min((r + 1) * per, spec.vocab_size)
    emb = torch.full((per, h), -1.0, dtype=torch.float64)
    emb[: end - start] = w[hf.EMBED][start:end]
    emb[end - start :] = 0
    out["emb"] = emb
    return out


# --- tests ----------------------------------------------------------------------------------

SPECS = [
    make_spec(fam, kv, tied, vocab)
    for fam, kv, tied, vocab in [
        ("llama", 1, False, 77),
        ("llama", 4, True, 130),
        ("qwen2", 2, True, 77),
        ("qwen2", 1, False, 200),
        ("qwen3", 2, False, 77),
        ("qwen3", 1, True, 129),
        ("qwen3", 4, False, 65),
    ]
]
IDS = [
    f"{s.family}-kv{s.num_kv_heads}-{'tied' if s.tie_word_embeddings else 'untied'}-v{s.vocab_size}"
    for s in SPECS
]


def test_cut_and_merge():
    pieces = (Piece("a", 0, 4), Piece("b", 10, 2), Piece("a", 4, 4))
    assert cut(pieces, 3, 4) == (Piece("a", 3, 1), Piece("b", 10, 2), Piece("a", 4, 1))
    assert cut((Piece("a", 0, 4), Piece("a", 4, 4)), 2, 4) == (Piece("a", 2, 4),)
    with pytest.raises(ValueError):
        cut(pieces, 6, 10)


# One layer's fused weights in each layout: reference key -> parameter name in the layer.
MEGATRON_LAYER = {
    "qkv": "self_attention.linear_qkv.weight", "qkv_bias": "self_attention.linear_qkv.bias",
    "fc1": "mlp.linear_fc1.weight", "proj": "self_attention.linear_proj.weight",
    "fc2": "mlp.linear_fc2.weight",
}  # fmt: skip
VLLM_LAYER = {
    "qkv": "self_attn.qkv_proj.weight", "qkv_bias": "self_attn.qkv_proj.bias",
    "gate_up": "mlp.gate_up_proj.weight", "o": "self_attn.o_proj.weight",
    "down": "mlp.down_proj.weight",
}  # fmt: skip


def assert_layer_equal(got, ref: dict, names: dict[str, str], qkv_bias: bool) -> None:
    """``got(name)`` equals ``ref[key]`` for each fused weight of one layer (the qkv bias
    only when the model has one)."""
    for key, name in names.items():
        if key != "qkv_bias" or qkv_bias:
            assert torch.equal(got(name), ref[key]), name


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_megatron_shards_match_reference(spec, tp):
    ml = mg.MegatronLayout(tp=tp)
    if spec.num_kv_heads % tp and tp % spec.num_kv_heads:
        pytest.skip("not a megatron layout")
    w = arange_hf(spec)
    read = reader_from_dict(w)
    vm = ml.vocab(spec)
    assert vm % (128 * tp) == 0 and vm >= spec.vocab_size
    for r in range(tp):
        for layer in range(spec.num_layers):
            ref = ref_megatron_rank(spec, w, layer, tp, r, vm)
            p = f"decoder.layers.{layer}."
            got = lambda n, p=p, r=r: assemble(mg.shard(spec, ml, p + n, 0, 0, r), read, F64)  # noqa: E731
            assert_layer_equal(got, ref, MEGATRON_LAYER, spec.qkv_bias)
            hfp = hf.layer_prefix(layer)
            for local, te, src in [
                (
                    "input_layernorm.weight",
                    "self_attention.linear_qkv.layer_norm_weight",
                    "input_layernorm.weight",
                ),
                (
                    "pre_mlp_layernorm.weight",
                    "mlp.linear_fc1.layer_norm_weight",
                    "post_attention_layernorm.weight",
                ),
            ]:
                assert torch.equal(got(local), w[hfp + src])
                assert torch.equal(got(te), w[hfp + src])
            if spec.qk_norm:
                assert torch.equal(
                    got("self_attention.q_layernorm.weight"), w[hfp + "self_attn.q_norm.weight"]
                )
                assert torch.equal(
                    got("self_attention.k_layernorm.weight"), w[hfp + "self_attn.k_norm.weight"]
                )
        emb = assemble(mg.shard(spec, ml, mg.EMBEDDING, 0, 0, r), read, F64)
        assert torch.equal(emb, ref["emb"])


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize(
    "tp,pp,vpp", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (4, 2, 1), (2, 2, 2)]
)
@pytest.mark.parametrize("norm_style", ["local", "te"])
def test_megatron_round_trip(spec, tp, pp, vpp, norm_style):
    """Cut every shard of every (pp, vp, tp) rank, scatter back: the HF tensors return."""
    if spec.num_kv_heads % tp and tp % spec.num_kv_heads:
        pytest.skip("not a megatron layout")
    ml = mg.MegatronLayout(tp=tp, pp=pp, vpp=vpp, norm_style=norm_style)
    mg.validate(spec, ml)
    w = arange_hf(spec)
    read = reader_from_dict(w)
    back = {n: torch.zeros_like(t) for n, t in w.items()}
    layers_seen = []
    for p, v in itertools.product(range(pp), range(vpp)):
        names = mg.chunk_names(spec, ml, p, v)
        local = {int(n.split(".")[2]) for n in names if n.startswith("decoder.layers.")}
        layers_seen += [mg.layer_offset(spec, ml, p, v) + j for j in local]
        assert (mg.OUTPUT in names) == (
            p == pp - 1 and v == vpp - 1 and not (spec.tie_word_embeddings and pp == 1)
        )
        assert (mg.EMBEDDING in names) == (p == 0 and v == 0)
        for r in range(tp):
            for n in names:
                lay = mg.shard(spec, ml, n, p, v, r)
                s = assemble(lay, read, F64)
                if n in (mg.EMBEDDING, mg.OUTPUT):
                    vocab_lo = r * ml.vocab(spec) // tp
                    pad_from = max(0, spec.vocab_size - vocab_lo)
                    assert not s[pad_from:].any(), "padding rows must be zero"
                scatter(lay, s, back)
    # megatron's layer offset: vp*(L/vpp) + pp_rank*(L/(pp*vpp)), each layer exactly once
    assert sorted(layers_seen) == list(range(spec.num_layers))
    for n, t in w.items():
        assert torch.equal(back[n], t), n


def test_layer_offset_formula():
    spec = make_spec(layers=8)
    ml = mg.MegatronLayout(pp=2, vpp=2)
    # get_transformer_layer_offset: 8 layers, pp 2, vpp 2 -> chunks of 2
    assert [mg.layer_offset(spec, ml, p, v) for v in range(2) for p in range(2)] == [0, 2, 4, 6]
    assert mg.layer_offset(spec, mg.MegatronLayout(pp=4), 3, 0) == 6


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vllm_shards_match_weight_loader(spec, tp):
    if spec.num_kv_heads % tp and tp % spec.num_kv_heads:
        with pytest.raises(ValueError):
            vl.validate(spec, tp)
        return
    vl.validate(spec, tp)
    w = arange_hf(spec)
    read = reader_from_dict(w)
    for r in range(tp):
        for layer in range(spec.num_layers):
            ref = ref_vllm_rank(spec, w, layer, tp, r)
            p = hf.layer_prefix(layer)
            got = lambda n, p=p, r=r: assemble(vl.shard(spec, tp, r, p + n), read, F64)  # noqa: E731
            assert_layer_equal(got, ref, VLLM_LAYER, spec.qkv_bias)
        assert torch.equal(assemble(vl.shard(spec, tp, r, hf.EMBED), read, F64), ref["emb"])
        names = vl.param_names(spec)
        assert ("lm_head.weight" in names) == (not spec.tie_word_embeddings)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("mtp,pp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)])
@pytest.mark.parametrize("vtp", [1, 2, 4])
def test_megatron_to_vllm_by_intersection(spec, mtp, pp, vtp):
    """Every vLLM shard, composed from Megatron shards by interval intersection only."""
    ok = lambda t: not (spec.num_kv_heads % t and t % spec.num_kv_heads)  # noqa: E731
    if not (ok(mtp) and ok(vtp)):
        pytest.skip("kv heads do not split")
    ml = mg.MegatronLayout(tp=mtp, pp=pp)
    w = arange_hf(spec)
    read = reader_from_dict(w)
    srcs = [
        (lay, assemble(lay, read, F64))
        for p in range(pp)
        for r in range(mtp)
        for lay in mg.chunk_shards(spec, ml, p, 0, r)
    ]
    for r in range(vtp):
        for dst in vl.rank_shards(spec, vtp, r):
            out = torch.full(dst.shape, float("nan"), dtype=torch.float64)
            for off, piece in dst.offsets():
                if piece.is_zero:
                    out.narrow(dst.dim, off, piece.length).zero_()
            for lay, t in srcs:
                if not set(lay.hf_names) & set(dst.hf_names):
                    continue
                for o in intersect(dst, lay):
                    out.narrow(dst.dim, o.dst_start, o.length).copy_(
                        t.narrow(dst.dim, o.src_start, o.length)
                    )
            assert torch.equal(out, assemble(dst, read, F64)), dst.name


def test_unknown_names_raise():
    spec = make_spec("llama")
    ml = mg.MegatronLayout(tp=2)
    for bad in [
        "decoder.layers.0.self_attention.linear_qkv.bias",
        "decoder.layers.9.mlp.linear_fc1.weight",
        "foo.weight",
    ]:
        with pytest.raises(
            mg.UnknownParameterError, match="unknown Megatron parameter|no QKV bias"
        ):
            mg.shard(spec, ml, bad)
    with pytest.raises(mg.UnknownParameterError, match="model.layers.0.self_attn.q_proj.weight"):
        vl.shard(spec, 2, 0, "model.layers.0.self_attn.q_proj.weight")
    # tied, PP=1: Megatron has no output_layer weight
    with pytest.raises(mg.UnknownParameterError):
        mg.shard(make_spec("llama", tied=True), mg.MegatronLayout(), mg.OUTPUT)


def test_megatron_validation_errors():
    spec = make_spec("llama", kv=2)
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by trainer tp=3"):
        mg.validate(spec, mg.MegatronLayout(tp=3))
    with pytest.raises(ValueError, match="num_layers=4 is not divisible"):
        mg.validate(spec, mg.MegatronLayout(pp=3))
    # ng < tp is allowed by megatron-core 0.16.1 (groups split by columns)
    mg.validate(make_spec("llama", kv=1), mg.MegatronLayout(tp=4))
