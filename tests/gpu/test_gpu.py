"""What one GPU can check (issue 11): the Megatron policy in bf16 on CUDA (local layers, and
Transformer-Engine layers when installed), log-prob parity bf16 vs fp32, the distributed
optimizer step, trainer offload/reload (bytes freed, seconds, bit-identical training), the
bridge's pack/unpack on CUDA tensors against a plain device copy, the transport over NCCL at
world size 1 (self-links), and the chunked log-prob's peak memory against plan's bound.

Needs torch and megatron-core only (no vLLM: the vLLM side is covered by the CPU suite).
Every figure goes to the ``figures`` fixture (tests/gpu/run_gpu_suite.py prints them)."""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from megatron_grpo.models.shapes import preset_spec
from tests.gpu.conftest import needs_cuda
from tests.helpers.steps import preset_policy, suite_batch, suite_loss

GIB = float(1 << 30)
HAS_TE = importlib.util.find_spec("transformer_engine") is not None


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _bf16(device):
    return "bfloat16"  # bf16 with fp32 main params runs on CPU too (platform/cpu.py)


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_policy_trains_in_bf16(ctx, device, figures, impl):
    if impl == "transformer_engine" and not (HAS_TE and device.type == "cuda"):
        pytest.skip("Transformer-Engine not installed (or no CUDA)")
    # lr 1e-2: Adam moves each weight by about lr per step, and a bf16 norm weight of 1.0
    # only changes once its fp32 main param has moved by half a bf16 ulp (2**-8).
    spec, policy = preset_policy(ctx, "tiny", _bf16(device), impl, lr=1e-2)
    batch = suite_batch(spec.vocab_size)
    before = {n: p.detach().clone() for n, p in policy.named_shards()}
    m1 = policy.train_step(batch, suite_loss, micro_batch_size=4)
    _sync()
    t0 = time.perf_counter()
    m2 = policy.train_step(batch, suite_loss, micro_batch_size=4)
    _sync()
    seconds = time.perf_counter() - t0
    assert all(torch.isfinite(torch.tensor([m["loss"], m["grad_norm"]])).all() for m in (m1, m2))
    assert not m1["skipped"] and not m2["skipped"]
    changed = sum(not torch.equal(before[n], p) for n, p in policy.named_shards())
    assert changed == len(before), f"only {changed}/{len(before)} shards moved"
    figures[f"policy_{impl}_train_step_s"] = seconds
    dtypes = {str(p.dtype) for p in before.values()}
    assert dtypes == {"torch.bfloat16"}, dtypes  # norms included: one training dtype
    figures[f"policy_{impl}_dtype"] = dtypes.pop()


def test_logprob_parity_bf16_vs_fp32(ctx, device, figures):
    spec, p32 = preset_policy(ctx, "tiny", "float32")
    _, p16 = preset_policy(ctx, "tiny", _bf16(device))
    p16.copy_weights_from(p32)
    batch = suite_batch(spec.vocab_size)
    a = p32.compute_logprobs(batch, micro_batch_size=4)
    b = p16.compute_logprobs(batch, micro_batch_size=4)
    m = batch.attention_mask.bool()
    m[:, 0] = False
    diff = (a["logp"] - b["logp"])[m].abs()
    ent = (a["entropy"] - b["entropy"])[m].abs()
    figures["logprob_bf16_vs_fp32_mean_abs"] = float(diff.mean())
    figures["logprob_bf16_vs_fp32_max_abs"] = float(diff.max())
    figures["entropy_bf16_vs_fp32_max_abs"] = float(ent.max())
    # bf16 has 8 mantissa bits: ~0.4% per logit, a few hundredths on a log-prob at most.
    assert float(diff.mean()) < 0.05 and float(diff.max()) < 0.5
    assert float(a["logp"][m].abs().mean()) > 1.0  # a random model: far from certain


def test_distributed_optimizer_step(ctx, device, figures):
    spec, dist_on = preset_policy(ctx, "tiny", "bfloat16", distributed_optimizer="on")
    _, dist_off = preset_policy(ctx, "tiny", "bfloat16", distributed_optimizer="off")
    dist_off.copy_weights_from(dist_on)
    batch = suite_batch(spec.vocab_size)
    a = dist_on.train_step(batch, suite_loss, micro_batch_size=4)
    b = dist_off.train_step(batch, suite_loss, micro_batch_size=4)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
    worst = max(
        (x.float() - y.float()).abs().max().item()
        for (_, x), (_, y) in zip(dist_on.named_shards(), dist_off.named_shards(), strict=True)
    )
    figures["distributed_optimizer_max_weight_diff_vs_plain"] = worst
    assert worst <= 2e-2  # one bf16 ulp at |w| ~ 1 after an lr=1e-3 step


def test_offload_reload(ctx, device, figures):
    """Offload -> reload -> train is bit-identical to never offloading; the first offload
    against a steady one. The offload is built before the first step, as the trainer builds
    it with the run (trainer/colocated_memory.py), so its pinned host buffers are allocated ahead
    (policy/offload.py) while the steps run."""
    from collections import Counter

    from megatron_grpo.policy.offload import TrainerOffload

    preset = "Qwen2.5-0.5B" if device.type == "cuda" else "tiny"
    spec, a = preset_policy(ctx, preset, _bf16(device))
    _, b = preset_policy(ctx, preset, _bf16(device))
    b.copy_weights_from(a)
    off = TrainerOffload(a)
    expected = Counter(off._expected_host_bytes())
    batch = suite_batch(spec.vocab_size, rows=4, length=128)
    a.train_step(batch, suite_loss, micro_batch_size=2)
    b.train_step(batch, suite_loss, micro_batch_size=2)
    _sync()
    alloc0 = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    rep = off.offload()
    taken = Counter(h.numel() for _, h in off._kept)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        freed = alloc0 - torch.cuda.memory_allocated()
        figures["offload_freed_allocated_gib"] = freed / GIB
        assert freed >= 0.95 * rep.bytes, (freed, rep.bytes)
    back = off.reload()
    steady = []
    for _ in range(3):
        steady.append(off.offload())
        off.reload()
    steady_s = sorted(r.seconds for r in steady)[1]
    figures["offload_gib"] = rep.bytes / GIB
    figures["offload_s"] = rep.seconds  # the first one
    figures["offload_first_waited_s"] = rep.waited_s  # for buffers still being pinned ahead
    figures["offload_host_reserve_s"] = off._host.reserve_s  # the ahead allocation, in all
    figures["offload_steady_s"] = steady_s  # median of the next three
    figures["offload_first_vs_steady"] = rep.seconds / max(steady_s, 1e-9)
    figures["offload_prediction_exact"] = taken == expected
    figures["reload_s"] = back.seconds
    figures["offload_gb_per_s"] = rep.bytes / 1e9 / max(rep.seconds, 1e-9)
    assert back.bytes == rep.bytes > 0
    assert all(r.bytes == rep.bytes for r in steady)
    a.train_step(batch, suite_loss, micro_batch_size=2)
    b.train_step(batch, suite_loss, micro_batch_size=2)
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.named_shards(), b.named_shards()))
    # The buffers allocated ahead are the ones the offload took (else it pinned on the spot).
    assert taken == expected, (
        sorted((taken - expected).items()),
        sorted((expected - taken).items()),
    )


def _trainer_sources(spec, tp, tp_rank, device, dtype):
    from megatron_grpo.layouts import megatron as mg
    from megatron_grpo.models.spec import megatron_padded_vocab

    ml = mg.MegatronLayout(tp, padded_vocab=megatron_padded_vocab(spec.vocab_size, tp, 128))
    g = torch.Generator(device=device).manual_seed(tp_rank)
    return {
        s.name: torch.randn(s.shape, generator=g, device=device).to(dtype)
        for s in mg.chunk_shards(spec, ml, 0, 0, tp_rank)
    }


def _bridge_plan(spec, tp, engines, element_size):
    from megatron_grpo.bridge.plan import build_plan
    from megatron_grpo.layouts.megatron import MegatronLayout
    from megatron_grpo.models.spec import megatron_padded_vocab

    layout = MegatronLayout(
        tp, 1, 1, 1, padded_vocab=megatron_padded_vocab(spec.vocab_size, tp, 128)
    )
    return build_plan(spec, layout, 1, engines, element_size=element_size)


def test_bridge_pack_unpack_bandwidth(device, figures):
    """Trainer TP=2 -> two vLLM TP=1 engines (ranks 0 and 1): rank 1's buckets to rank 0 are
    packed by the transport's own ``packer.pack`` into its own bucket buffers and unpacked by
    the receiver's ``packer.unpack`` (what ``Transport.run_plan`` runs on each side of the wire), timed
    against one plain device copy of as many bytes (the bound a pack can reach)."""
    from megatron_grpo.bridge.transport import Transport

    spec = preset_spec("Qwen2.5-0.5B" if device.type == "cuda" else "tiny")
    dtype = torch.bfloat16
    plan = _bridge_plan(spec, 2, [[0], [1]], element_size=2)
    src = _trainer_sources(spec, 2, 1, device, dtype)
    link = (1, 0)
    sender = Transport(plan, 1, device=device, dtype=dtype, bucket_mb=256)
    receiver = Transport(plan, 0, device=device, dtype=dtype, bucket_mb=256)
    buckets = sender.schedule[link]
    bufs = sender._buffers_for(link)  # the sync's window of bucket buffers
    dst = {n: torch.zeros(s, dtype=dtype, device=device) for n, s in receiver.dst_shapes.items()}
    nbytes = sum(b.numel for b in buckets) * 2

    def timed(step) -> float:
        _sync()
        t0 = time.perf_counter()
        for i, b in enumerate(buckets):
            step(b, bufs[i % len(bufs)])
        _sync()
        return time.perf_counter() - t0

    def pack(b, buf):
        sender.packer.pack(src, b, buf)

    def unpack(b, buf):
        receiver.packer.unpack(b, buf, dst.__getitem__)

    def both(b, buf):
        pack(b, buf)
        unpack(b, buf)

    timed(both)  # warm-up: the buffer views are made and cached here
    pack_s = min(timed(pack) for _ in range(5))
    unpack_s = min(timed(unpack) for _ in range(5))
    flat_a = torch.empty(nbytes // 2, dtype=dtype, device=device)
    flat_b = torch.empty_like(flat_a)
    copy_s = []
    for _ in range(5):
        _sync()
        t0 = time.perf_counter()
        flat_b.copy_(flat_a)
        _sync()
        copy_s.append(time.perf_counter() - t0)
    # Every byte of every destination slice came from the source slice the plan names.
    for b in buckets:
        for t in dst.values():
            t.fill_(float("nan"))
        both(b, bufs[0])
        for e in b.entries:
            c = e.copy
            got = dst[c.dst_name].narrow(c.dim, c.dst_start, c.length)
            assert torch.equal(got, src[c.src_name].narrow(c.dim, c.src_start, c.length))
    # fp32 shards on a bf16 wire: the batched copies cast as copy_ does, bit for bit.
    src32 = {n: t.float() + torch.rand_like(t, dtype=torch.float32) * 1e-3 for n, t in src.items()}
    for b in buckets:
        sender.packer.pack(src32, b, bufs[0])
        for e in b.entries:
            c = e.copy
            got = bufs[0][e.offset : e.offset + e.numel].view(e.shape)
            want = torch.empty(e.shape, dtype=dtype, device=device)
            want.copy_(src32[c.src_name].narrow(c.dim, c.src_start, c.length))
            assert torch.equal(got, want), c.src_name
    figures["bridge_link_gib"] = nbytes / GIB
    figures["bridge_link_slices"] = sum(len(b.entries) for b in buckets)
    figures["bridge_pack_runs"] = sum(len(b.pack_runs) for b in buckets)
    figures["bridge_unpack_runs"] = sum(len(b.unpack_runs) for b in buckets)
    figures["bridge_pack_gb_per_s"] = nbytes / 1e9 / pack_s
    figures["bridge_unpack_gb_per_s"] = nbytes / 1e9 / unpack_s
    figures["device_copy_gb_per_s"] = nbytes / 1e9 / min(copy_s)
    figures["bridge_pack_vs_device_copy"] = min(copy_s) / pack_s
    figures["bridge_unpack_vs_device_copy"] = min(copy_s) / unpack_s


def test_transport_world_size_1_self_links(ctx, device, figures):
    import torch.distributed as dist

    from megatron_grpo.bridge.transport import Transport

    spec = preset_spec("Qwen2.5-0.5B" if device.type == "cuda" else "tiny")
    dtype = torch.bfloat16
    plan = _bridge_plan(spec, 1, [[0]], element_size=2)
    src = _trainer_sources(spec, 1, 0, device, dtype)
    tr = Transport(plan, 0, group=dist.group.WORLD, device=device, dtype=dtype, timeout_s=60)
    got = {}
    tr.run_plan(src, deliver=lambda n, t: got.__setitem__(n, t))  # warm-up (allocations)
    _sync()
    got.clear()
    t0 = time.perf_counter()
    st, _ = tr.run_plan(src, deliver=lambda n, t: got.__setitem__(n, t))
    _sync()
    seconds = time.perf_counter() - t0
    assert set(got) == {d.name for d in plan.dst_tensors}
    assert st.bytes_sent == 0 and st.bytes_local == plan.minimal_bytes
    for c in plan.copies[:50]:
        assert torch.equal(
            got[c.dst_name].narrow(c.dim, c.dst_start, c.length),
            src[c.src_name].narrow(c.dim, c.src_start, c.length),
        )
    figures["transport_ws1_backend"] = dist.get_backend()
    figures["transport_ws1_gib"] = plan.minimal_bytes / GIB
    figures["transport_ws1_s"] = seconds
    figures["transport_ws1_gb_per_s"] = plan.minimal_bytes / 1e9 / seconds


def test_chunked_logprob_peak_vs_plan(device, figures):
    """The vocab-parallel log-prob of one micro-batch (DeepScaleR's: Qwen's 151,936 columns)
    stays within what ``plan`` counts for it: logits, their gradient and the chunk's fp32
    temporaries (dry_run/memory.py ``activation_bytes``)."""
    needs_cuda()
    from megatron_grpo.policy.logprob import logprob_peak_bytes, vocab_parallel_logprob_entropy

    n, v = 4 * 4096, 151936
    logits = torch.randn(n, v, device=device, dtype=torch.bfloat16).requires_grad_(True)
    target = torch.randint(0, v, (n,), device=device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    logp, ent = vocab_parallel_logprob_entropy(logits, target, vocab_start=0, vocab_size=v)
    (logp.sum() + ent.sum()).backward()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    measured = torch.cuda.max_memory_allocated() - base + logits.numel() * 2
    plan_bytes = 3 * 2 * n * v + logprob_peak_bytes(n, v)  # scoring_bytes("logits", ...)
    figures["logprob_tokens"] = n
    figures["logprob_peak_gib"] = measured / GIB
    figures["logprob_plan_gib"] = plan_bytes / GIB
    figures["logprob_unchunked_fp32_gib_estimate"] = 8 * 4 * n * v / GIB
    figures["logprob_fwd_bwd_s"] = seconds
    assert measured <= plan_bytes, (measured / GIB, plan_bytes / GIB)


def test_bench_ops_on_cuda(ctx, figures):
    """``bench ops`` on the GPU (tiny preset, bf16): the profiler's kernel launches and host
    synchronizations per train step and log-prob pass, next to the ATen-op counts the CPU
    suite holds (tests/op_budget.json); the one-copy transfer (pinned, non-blocking) and the
    packed RoPE run here on CUDA. Issue 30's goal: at most 2 host syncs per micro-batch plus
    a constant per step."""
    needs_cuda()
    from megatron_grpo.bench.ops.run import BenchOpsArgs, run_bench_ops

    res = run_bench_ops(BenchOpsArgs(device="cuda"), ctx)
    mbs = res["batch"]["micro_batches"]
    for phase, c in res["phases"].items():
        figures[f"ops_{phase}_aten"] = c["ops"]["total"]
        figures[f"ops_{phase}_kernel_launches"] = c["cuda"]["kernel_launches"]
        figures[f"ops_{phase}_host_syncs"] = c["cuda"]["host_syncs"]
        assert c["cuda"]["host_syncs"] <= 2 * mbs + 8, (phase, c["cuda"], c["syncs"])


def test_fused_logprob_peak_vs_plan(device, figures):
    """The fused output layer + log-prob + entropy of the same micro-batch (hidden 896: the
    0.5B shape) stays within ``plan``'s ``fused_peak_bytes`` and holds no logits."""
    needs_cuda()
    from megatron_grpo.policy.fused_logprob import fused_logprob_entropy, fused_peak_bytes

    n, v, h = 4 * 4096, 151936, 896
    hidden = torch.randn(n, h, device=device, dtype=torch.bfloat16).requires_grad_(True)
    weight = (0.02 * torch.randn(v, h, device=device)).to(torch.bfloat16).requires_grad_(True)
    target = torch.randint(0, v, (n,), device=device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    logp, ent = fused_logprob_entropy(hidden, weight, target, vocab_start=0, vocab_size=v)
    (logp.sum() + ent.sum()).backward()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    measured = torch.cuda.max_memory_allocated() - base
    plan_bytes = fused_peak_bytes(n, v, h, 2)
    figures["fused_logprob_peak_gib"] = measured / GIB
    figures["fused_logprob_plan_gib"] = plan_bytes / GIB
    figures["fused_logprob_fwd_bwd_s"] = seconds
    assert measured <= plan_bytes, (measured / GIB, plan_bytes / GIB)
