"""``megatron-grpo bench sync``: the resharding bridge vs the anchors' gather-and-broadcast
vs a raw flat transfer of the same bytes, on the same processes and process group.

Placement: colocated, as in the trainer (``bridge/weight_sync.py``): ``world =
lcm(tp*pp, rollout_tp)`` spawned ranks, each a Megatron trainer rank (dp = world/(tp*pp))
hosting one vLLM TP rank (``external_launcher``). With ``sink="null"`` no vLLM engine is
started: the bridge builds the destination shards and drops them, and the baseline drops
the full tensors -- the transfer alone, for shapes whose vLLM engine would not fit.

Every rank loads the HF checkpoint into Megatron, then scales all weights by 0.9 before
each measured method, so that the engine (started from the unscaled checkpoint) must
really receive new weights for the checks to pass:
- destination shards equal the same shards assembled from the HF checkpoint (scaled) by
  the layouts' vLLM slicing -- independent of the plan's routing;
- vLLM's read-back checksums equal those of the shards delivered (``bridge.verify``);
- vLLM's prompt logprobs match the Megatron policy's on fixed sequences.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_grpo.bench.raw import RawTransfer
from megatron_grpo.bridge.accounting import SyncReport
from megatron_grpo.bridge.baseline import BaselineSync
from megatron_grpo.bridge.checksum import checksum
from megatron_grpo.bridge.plan import build_plan
from megatron_grpo.bridge.transport import Transport
from megatron_grpo.bridge.verify import (
    compare_checksums,
    fixed_sequences,
    logprob_parity,
    pad_batch,
)
from megatron_grpo.config import ConfigError
from megatron_grpo.config.schema import ModelConfig, ParallelConfig
from megatron_grpo.distributed import init_distributed, spawn
from megatron_grpo.layouts import vllm as vl
from megatron_grpo.layouts.io import HFCheckpointReader, load_hf_into_megatron
from megatron_grpo.layouts.megatron import MegatronLayout
from megatron_grpo.layouts.pieces import assemble
from megatron_grpo.models.spec import check_heads, load_spec
from megatron_grpo.models.tiny import PRESETS, build_hf_model
from megatron_grpo.plan.placement import colocated_engines
from megatron_grpo.platform.cpu import device_mode_suspended
from megatron_grpo.policy.policy import build_policy
from megatron_grpo.rollout.engine import RolloutEngine

MiB = 1 << 20


@dataclass
class BenchSyncArgs:
    model: str = "tiny"
    """HF model directory or a preset of ``models/tiny.py``."""
    train_tp: int = 1
    train_pp: int = 1
    rollout_tp: int = 1
    bucket_mb: list[float] = field(default_factory=lambda: [64.0])
    repeats: int = 3
    sink: str = "vllm"
    """``vllm``: real colocated engines; ``null``: transfer only; ``vllm-fresh``: ``vllm``
    plus vLLM loading the same weights from a freshly written safetensors directory (its own
    loader, what a user without the bridge would do), timed side by side."""
    timeout_s: float = 120.0
    parity_tol: float = 1e-3
    cache_dir: str = "runs/bench"
    threads: int = 1
    """torch threads per rank (2-core machines: 1)."""

    def __post_init__(self) -> None:
        for k in ("train_tp", "train_pp", "rollout_tp", "repeats"):
            if getattr(self, k) < 1:
                raise ValueError(f"--{k.replace('_', '-')}={getattr(self, k)} must be >= 1.")
        if self.sink not in ("vllm", "null", "vllm-fresh"):
            raise ValueError(f"--sink={self.sink!r} must be 'vllm', 'vllm-fresh' or 'null'.")
        if not self.bucket_mb or any(b <= 0 for b in self.bucket_mb):
            raise ValueError(f"--bucket-mb={self.bucket_mb}: give positive sizes, e.g. 16,64.")

    @property
    def world(self) -> int:
        tp_pp = self.train_tp * self.train_pp
        return tp_pp * self.rollout_tp // math.gcd(tp_pp, self.rollout_tp)


def resolve_model(args: BenchSyncArgs) -> Path:
    if args.model in PRESETS:
        target = Path(args.cache_dir) / "hf_model" / args.model
        if not (target / "config.json").is_file():
            print(f"building random-weight {args.model} in {target} ...", flush=True)
            build_hf_model(target, args.model, with_tokenizer=True)
        return target
    path = Path(args.model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--model {args.model!r} is neither a preset ({sorted(PRESETS)}) nor an HF "
            "directory with a config.json."
        )
    return path


# ------------------------------------------------------------------------------ per rank


def _gather_stats(st):
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, st)
    return everyone


def _expected_shards(spec, hf_dir: Path, rollout_tp: int, tp_rank: int, scale: float):
    """This vLLM rank's shards assembled from the HF checkpoint by the layouts (no plan)."""
    import torch

    reader = HFCheckpointReader(hf_dir)

    def read(name, dim, start, length):
        return reader.read(name, dim, start, length).float() * scale

    return {
        lay.name: assemble(lay, read, dtype=torch.float32)
        for lay in vl.rank_shards(spec, rollout_tp, tp_rank)
    }


def _scale_policy(policy, factor: float) -> None:
    import torch

    with torch.no_grad():
        for _, p in policy.named_shards():
            p.mul_(factor)


def _parity(policy, engine, seqs, tol):
    logp = policy.compute_logprobs(pad_batch(seqs), micro_batch_size=len(seqs))["logp"]
    return logprob_parity(logp, engine.prompt_logprobs(seqs), [len(s) for s in seqs], tol)


def bench_rank(rank: int, world: int, a: BenchSyncArgs, hf_dir: str) -> dict:
    from functools import partial

    import torch
    import torch.distributed as dist

    spec = load_spec(hf_dir)
    ctx = init_distributed(
        ParallelConfig(
            tp=a.train_tp, pp=a.train_pp, backend="gloo", timeout_s=max(600.0, a.timeout_s)
        ),
        spec,
    )
    t0 = time.perf_counter()
    policy = build_policy(
        spec, ctx, ModelConfig(hf_path=hf_dir, dtype="float32", transformer_impl="local"), None,
        init_weights=partial(load_hf_into_megatron, hf_dir=hf_dir, spec=spec, ctx=ctx),
    )  # fmt: skip
    setup = {"policy_s": time.perf_counter() - t0}
    engine = None
    if a.sink in ("vllm", "vllm-fresh"):
        t0 = time.perf_counter()
        engine = RolloutEngine(
            hf_dir, tp=a.rollout_tp, max_model_len=64, cpu_kv_cache_gb=0.05, enforce_eager=True,
            keep_weight_copies=False,
        )  # fmt: skip
        setup["engine_s"] = time.perf_counter() - t0
    shards = dict(policy.named_shards())
    dtype = next(iter(shards.values())).dtype
    padded_vocab = policy.vocab_per_rank * ctx.tp
    layout = MegatronLayout.of(ctx, shards, padded_vocab)
    t0 = time.perf_counter()
    plan = build_plan(
        spec, layout, a.rollout_tp, colocated_engines(world, a.rollout_tp),
        element_size=torch.empty((), dtype=dtype).element_size(),
    )  # fmt: skip
    setup["plan_s"] = time.perf_counter() - t0
    vllm_tp_rank = rank % a.rollout_tp
    seqs = fixed_sequences(spec.vocab_size)
    out: dict = {"setup": setup, "direct": {}, "checks": {}}
    scale = 1.0

    def check(method: str, delivered: dict[str, torch.Tensor] | None, sent_sums) -> dict:
        res: dict = {}
        if delivered is not None:  # bridge: shards equal the layouts' slicing of HF
            exp = _expected_shards(spec, Path(hf_dir), a.rollout_tp, vllm_tp_rank, scale)
            bad = [n for n, t in exp.items() if n in delivered and not torch.equal(delivered[n], t)]
            res["shards_checked"] = len(exp)
            res["shards_missing"] = sorted(set(exp) - set(delivered))
            res["shards_mismatched"] = bad
            res["shards_ok"] = not bad and not res["shards_missing"]
        if engine is not None:
            if sent_sums is not None:
                rep = compare_checksums(rank, sent_sums, engine.receiver.checksums())
                res["checksums"] = rep.to_dict()
            res["parity"] = _parity(policy, engine, seqs, a.parity_tol).to_dict()
        return res

    # -- direct bridge, per bucket size ------------------------------------------------
    for bi, bucket_mb in enumerate(a.bucket_mb):
        tr = Transport(plan, rank, bucket_mb=bucket_mb, timeout_s=a.timeout_s, dtype=dtype)
        reports = []
        for rep in range(a.repeats):
            verify_now = bi == 0 and rep == 0
            if verify_now:
                scale *= 0.9
                _scale_policy(policy, 0.9)
                if engine is not None:
                    out["checks"]["parity_before_direct"] = _parity(
                        policy, engine, seqs, a.parity_tol
                    ).to_dict()
            delivered: dict[str, torch.Tensor] = {}
            sent_sums: dict = {}
            if engine is not None:
                rx = engine.begin_weight_update(record_checksums=verify_now)

                def sink(name, t, rx=rx, keep=verify_now, delivered=delivered, sums=sent_sums):
                    if keep:
                        delivered[name] = t
                        sums[name] = checksum(t)
                    rx.receive_shard(name, t)

                finish = engine.finish_weight_update
            else:

                def sink(name, t, keep=verify_now, delivered=delivered):
                    if keep:
                        delivered[name] = t

                finish = None
            dist.barrier()
            with torch.no_grad(), device_mode_suspended():
                st, _ = tr.sync(shards, deliver=sink, finish=finish)
            if engine is not None:
                engine.update_phases(st)
            reports.append(SyncReport.merge(_gather_stats(st)).to_dict())
            if verify_now:
                out["checks"]["direct"] = check("direct", delivered, sent_sums if engine else None)
            del delivered
        out["direct"][bucket_mb] = reports
        out["bucket_memory_bytes"] = tr.bucket_memory_bytes

    # -- baseline ------------------------------------------------------------------------
    base = BaselineSync(policy.models, spec, ctx, engine, padded_vocab=padded_vocab)
    out["baseline"] = []
    for rep in range(a.repeats):
        if rep == 0:
            scale *= 0.9
            _scale_policy(policy, 0.9)
        dist.barrier()
        st = base.sync()
        out["baseline"].append(SyncReport.merge(_gather_stats(st)).to_dict())
        if rep == 0 and engine is not None:
            out["checks"]["baseline"] = check("baseline", None, None)

    # -- vLLM's own load from a fresh safetensors directory ---------------------------
    if a.sink == "vllm-fresh":
        out["vllm_fresh"] = _fresh_load(a, engine, Path(hf_dir), scale, rank, policy, seqs)

    # -- raw flat transfer of the same bytes -------------------------------------------
    raw = RawTransfer(plan.bytes_per_link(), rank, dtype=dtype, timeout_s=a.timeout_s)
    out["raw"] = []
    for _ in range(a.repeats):
        dist.barrier()
        out["raw"].append(SyncReport.merge(_gather_stats(raw.run())).to_dict())

    out["minimal_bytes"] = plan.minimal_bytes
    out["plan"] = {"copies": len(plan.copies), "dst_tensors": len(plan.dst_tensors)}
    if engine is not None:
        out["weight_version"] = engine.weight_version
    dist.barrier()
    if engine is not None:  # the spawned ranks leave by os._exit: release vLLM's segments
        engine.shutdown()
    return out


def _write_scaled_hf(hf_dir: Path, dst: Path, scale: float) -> None:
    """``hf_dir`` with every weight multiplied by ``scale`` (in float32), as a trainer would
    save its current weights for vLLM to load."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(hf_dir.iterdir()):
        if f.suffix == ".safetensors":
            sd = {k: v.float() * scale for k, v in load_file(f).items()}
            save_file(sd, dst / f.name, metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy(f, dst / f.name)


def _fresh_load(a: BenchSyncArgs, engine, hf_dir: Path, scale: float, rank, policy, seqs):
    """vLLM reloading the current weights from a freshly written safetensors directory
    (``RolloutEngine.reload_from_hf``: vLLM's own narrowing loaders in its reload path), the
    floor a user without the bridge gets; the write (rank 0) is timed apart."""
    import os
    import shutil

    import torch.distributed as dist

    fresh = Path(a.cache_dir) / f"fresh-{os.environ.get('MASTER_PORT', '0')}"
    t0 = time.perf_counter()
    if rank == 0:
        _write_scaled_hf(hf_dir, fresh, scale)
    write_s = time.perf_counter() - t0
    dist.barrier()
    engine.receiver.record_checksums = False  # read-back is not part of vLLM's load
    seconds = []
    for _ in range(a.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        engine.reload_from_hf(fresh)
        seconds.append(time.perf_counter() - t0)
    engine.receiver.record_checksums = True
    parity = _parity(policy, engine, seqs, a.parity_tol).to_dict()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(fresh, ignore_errors=True)
    return {"seconds_all": seconds, "write_s": write_s, "parity": parity}


# ------------------------------------------------------------------------------ summary


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(a: BenchSyncArgs, per_rank: list[dict], hf_dir: Path) -> dict:
    r0 = per_rank[0]
    spec = load_spec(hf_dir)

    def method(reports: list[dict]) -> dict:
        keys = (
            "bytes",
            "wire_bytes",
            "local_bytes",
            "seconds",
            "pack_s",
            "transfer_s",
            "unpack_s",
            "load_s",
            "finish_s",
            "handshake_s",
        )
        d = {k: _median([r[k] for r in reports]) for k in keys}
        d["bytes"] = int(reports[0]["bytes"])
        d["wire_bytes"] = int(reports[0]["wire_bytes"])
        d["local_bytes"] = int(reports[0]["local_bytes"])
        d["seconds_all"] = [r["seconds"] for r in reports]
        d["first_seconds"] = reports[0]["seconds"]
        d["bytes_per_link"] = reports[0]["bytes_per_link"]
        d["peak_bucket_bytes"] = reports[0]["peak_bucket_bytes"]
        # Disjoint phases summing to ``seconds`` (``SyncStats.breakdown``), median per phase.
        d["breakdown"] = {
            k: _median([r["breakdown"][k] for r in reports]) for k in reports[0]["breakdown"]
        }
        # The transfer alone: wall time minus vLLM's per-tensor load and post-processing.
        d["transport_s"] = _median([r["seconds"] - r["load_s"] - r["finish_s"] for r in reports])
        return d

    by_bucket = {str(b): {**method(reps), "bucket_mb": b} for b, reps in r0["direct"].items()}
    best = min(by_bucket.values(), key=lambda d: d["seconds"])
    checks = [r["checks"] for r in per_rank]

    def ok(c: dict) -> bool:
        parts = []
        if "direct" in c:
            d = c["direct"]
            parts.append(d.get("shards_ok", True))
            if "checksums" in d:
                parts.append(d["checksums"]["ok"])
            if "parity" in d:
                parts.append(d["parity"]["ok"])
        if "baseline" in c and "parity" in c["baseline"]:
            parts.append(c["baseline"]["parity"]["ok"])
        return bool(parts) and all(parts)

    def transfer_ok(c: dict) -> bool:
        d = c.get("direct", {})
        return bool(d.get("shards_ok")) and d.get("checksums", {"ok": True})["ok"]

    raw = method(r0["raw"])
    result = {
        "model": a.model,
        "model_params": spec.num_parameters,
        "train_tp": a.train_tp,
        "train_pp": a.train_pp,
        "train_dp": a.world // (a.train_tp * a.train_pp),
        "rollout_tp": a.rollout_tp,
        "world": a.world,
        "sink": a.sink,
        "repeats": a.repeats,
        "minimal_bytes": r0["minimal_bytes"],
        "direct": best,
        "direct_by_bucket": by_bucket,
        "baseline": method(r0["baseline"]),
        "raw": raw,
        "direct_over_raw": best["seconds"] / raw["seconds"] if raw["seconds"] else None,
        "direct_transport_over_raw": (
            best["transport_s"] / raw["seconds"] if raw["seconds"] else None
        ),
        "baseline_over_direct": method(r0["baseline"])["seconds"] / best["seconds"],
        # The fixed cost over the bytes, and the ratio to what no bridge can avoid: the raw
        # transfer of the same bytes plus vLLM's own post-load processing (the CPU repack).
        "direct_minus_raw_s": best["seconds"] - raw["seconds"],
        "direct_over_floor": best["seconds"] / (raw["seconds"] + best["breakdown"]["vllm_post"])
        if raw["seconds"]
        else None,
        "verified": all(ok(c) for c in checks),
        # Bit-exact delivery alone (shards + vLLM read-back checksums), without the logprob
        # parity, which also depends on Megatron-vs-vLLM forward numerics.
        "verified_transfer": all(transfer_ok(c) for c in checks),
        "checks": checks,
        "setup": [r["setup"] for r in per_rank],
        "plan": r0["plan"],
        "bucket_memory_bytes": r0.get("bucket_memory_bytes"),
    }
    if "vllm_fresh" in r0:  # a load is over when its slowest rank is
        per_rep = [max(r["vllm_fresh"]["seconds_all"][i] for r in per_rank) for i in
                   range(len(r0["vllm_fresh"]["seconds_all"]))]  # fmt: skip
        result["vllm_fresh"] = {
            "seconds": _median(per_rep),
            "seconds_all": per_rep,
            "write_s": r0["vllm_fresh"]["write_s"],
            "parity_ok": all(r["vllm_fresh"]["parity"]["ok"] for r in per_rank),
            "parity_max_abs_diff": max(r["vllm_fresh"]["parity"]["max_abs_diff"] for r in per_rank),
        }
        result["vllm_fresh_over_direct"] = result["vllm_fresh"]["seconds"] / best["seconds"]
    return result


def format_table(res: dict) -> str:
    lines = [
        f"bench sync: {res['model']} ({res['model_params'] / 1e6:.1f}M params), trainer "
        f"tp={res['train_tp']} pp={res['train_pp']} dp={res['train_dp']} -> vLLM tp="
        f"{res['rollout_tp']} x{res['world'] // res['rollout_tp']} engines, sink={res['sink']}, "
        f"median of {res['repeats']}",
        f"minimal bytes: {res['minimal_bytes'] / MiB:.2f} MiB",
        f"{'method':<22}{'MiB moved':>10}{'wire MiB':>10}{'seconds':>9}{'pack':>8}{'xfer':>8}"
        f"{'unpack':>8}{'load':>8}{'finish':>8}",
    ]

    def row(name: str, d: dict) -> str:
        return (
            f"{name:<22}{d['bytes'] / MiB:>10.2f}{d['wire_bytes'] / MiB:>10.2f}{d['seconds']:>9.4f}"
            f"{d['pack_s']:>8.4f}{d['transfer_s']:>8.4f}{d['unpack_s']:>8.4f}{d['load_s']:>8.4f}"
            f"{d['finish_s']:>8.4f}"
        )

    for b, d in res["direct_by_bucket"].items():
        lines.append(row(f"direct (bucket {b} MB)", d))
    lines.append(row("baseline (gather+bcast)", res["baseline"]))
    lines.append(row("raw (1 flat buf/link)", res["raw"]))
    if "vllm_fresh" in res:
        f = res["vllm_fresh"]
        lines.append(
            f"{'vllm-fresh (HF load)':<22}{'':>10}{'':>10}{f['seconds']:>9.4f}   (+ write "
            f"{f['write_s']:.4f} s on rank 0; parity ok={f['parity_ok']})  "
            f"fresh/direct = {res['vllm_fresh_over_direct']:.2f}x"
        )
    b = res["direct"]["breakdown"]
    lines.append("direct breakdown (s): " + "  ".join(f"{k} {v:.4f}" for k, v in b.items()))
    lines.append(
        f"direct - raw = {res['direct_minus_raw_s']:.4f} s   direct / (raw + vllm_post) = "
        f"{res['direct_over_floor']:.2f}x"
    )
    lines.append(
        f"direct/raw = {res['direct_over_raw']:.2f}x (transport only "
        f"{res['direct_transport_over_raw']:.2f}x)   baseline/direct = "
        f"{res['baseline_over_direct']:.2f}x   direct bytes == minimal: "
        f"{res['direct']['bytes'] == res['minimal_bytes']}   verified: {res['verified']} "
        f"(transfer bit-exact: {res['verified_transfer']})"
    )
    for r, c in enumerate(res["checks"]):
        d = c.get("direct", {})
        bits = [f"rank {r}: shards_ok={d.get('shards_ok')}"]
        if "checksums" in d:
            bits.append(f"checksums {d['checksums']['checked']} ok={d['checksums']['ok']}")
        if "parity" in d:
            bits.append(f"parity max|dlogp| direct={d['parity']['max_abs_diff']:.2e}")
        if "parity_before_direct" in c:
            bits.append(f"(before sync {c['parity_before_direct']['max_abs_diff']:.2e})")
        if "parity" in c.get("baseline", {}):
            bits.append(f"baseline={c['baseline']['parity']['max_abs_diff']:.2e}")
        lines.append("  " + ", ".join(bits))
    return "\n".join(lines)


def run_bench_sync(a: BenchSyncArgs) -> dict:
    hf_dir = resolve_model(a)
    try:  # before any rank starts, not vLLM's pydantic error from a spawned rank
        check_heads(load_spec(hf_dir), a.train_tp, a.rollout_tp)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    t0 = time.perf_counter()
    # through the module: tests/bad_inputs.py stubs spawn_ranks out there
    per_rank = spawn.spawn_ranks(bench_rank, a.world, a, str(hf_dir), timeout_s=3600.0,
                                 threads=a.threads)  # fmt: skip
    res = summarize(a, per_rank, hf_dir)
    res["wall_s"] = time.perf_counter() - t0
    res["args"] = asdict(a)
    return res
