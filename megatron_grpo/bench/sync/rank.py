"""One spawned rank of ``bench sync`` (the command: ``bench/sync/run.py``): the Megatron policy
and (``sink`` vllm) the colocated engine, then the direct bridge per bucket size, the
baseline, vLLM's own load from a fresh directory (``vllm-fresh``) and the raw transfer, each
timed and the first of each checked."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_grpo.bench.sync.args import BenchSyncArgs
from megatron_grpo.bench.sync.raw import RawTransfer
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
from megatron_grpo.config.schema import ModelConfig, ParallelConfig
from megatron_grpo.distributed import init_distributed
from megatron_grpo.distributed.placement import colocated_engines
from megatron_grpo.layouts import vllm as vl
from megatron_grpo.layouts.io import HFCheckpointReader, load_hf_into_megatron
from megatron_grpo.layouts.megatron import MegatronLayout
from megatron_grpo.layouts.pieces import assemble
from megatron_grpo.models.spec import load_spec
from megatron_grpo.platform.cpu import device_mode_suspended
from megatron_grpo.policy.policy import build_policy
from megatron_grpo.rollout.engine import RolloutEngine

SCALE = 0.9
"""Every weight is multiplied by this before each measured method's first sync, so that the
engine (started from the unscaled checkpoint) must really receive new weights."""


def _gather_stats(st: Any) -> list[Any]:
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


@dataclass
class _Sink:
    """Where a direct sync delivers each destination shard: the engine's receiver (``rx``;
    None for the null sink), recording the shards and their checksums when ``keep``."""

    rx: Any
    keep: bool
    delivered: dict = field(default_factory=dict)
    sums: dict = field(default_factory=dict)

    def __call__(self, name: str, t) -> None:
        if self.keep:
            self.delivered[name] = t
            if self.rx is not None:
                self.sums[name] = checksum(t)
        if self.rx is not None:
            self.rx.receive_shard(name, t)


class RankBench:
    """One rank's policy, engine (None for the null sink), plan and fixed sequences; each
    ``run_*`` adds one method's reports (and its first sync's checks) to ``out``."""

    def __init__(self, rank: int, world: int, a: BenchSyncArgs, hf_dir: str) -> None:
        from functools import partial

        import torch

        self.rank, self.a, self.hf_dir = rank, a, hf_dir
        self.spec = spec = load_spec(hf_dir)
        self.ctx = ctx = init_distributed(
            ParallelConfig(
                tp=a.train_tp,
                pp=a.train_pp,
                ep=a.train_ep,
                backend="gloo",
                timeout_s=max(600.0, a.timeout_s),
            ),
            spec,
        )
        t0 = time.perf_counter()
        self.policy = build_policy(
            spec, ctx, ModelConfig(hf_path=hf_dir, dtype="float32", transformer_impl="local"),
            None, init_weights=partial(load_hf_into_megatron, hf_dir=hf_dir, spec=spec, ctx=ctx),
        )  # fmt: skip
        self.setup = {"policy_s": time.perf_counter() - t0}
        self.engine = None
        if a.sink in ("vllm", "vllm-fresh"):
            t0 = time.perf_counter()
            self.engine = RolloutEngine(
                hf_dir, tp=a.rollout_tp, max_model_len=64, cpu_kv_cache_gb=0.05,
                enforce_eager=True, keep_weight_copies=False,
            )  # fmt: skip
            self.setup["engine_s"] = time.perf_counter() - t0
        self.shards = dict(self.policy.named_shards())
        self.dtype = next(iter(self.shards.values())).dtype
        self.padded_vocab = self.policy.vocab_per_rank * ctx.tp
        layout = MegatronLayout.of(ctx, self.shards, self.padded_vocab)
        t0 = time.perf_counter()
        self.plan = build_plan(
            spec, layout, a.rollout_tp, colocated_engines(world, a.rollout_tp),
            element_size=torch.empty((), dtype=self.dtype).element_size(),
        )  # fmt: skip
        self.setup["plan_s"] = time.perf_counter() - t0
        self.vllm_tp_rank = rank % a.rollout_tp
        self.seqs = fixed_sequences(spec.vocab_size)
        self.scale = 1.0

    def parity(self) -> dict:
        return _parity(self.policy, self.engine, self.seqs, self.a.parity_tol).to_dict()

    def scale_weights(self) -> None:
        """The next method's weights: every weight times ``SCALE``."""
        self.scale *= SCALE
        _scale_policy(self.policy, SCALE)

    def check(self, delivered: dict | None, sent_sums: dict | None) -> dict:
        """The first sync's checks: the delivered shards against the layouts' slicing of HF
        (bridge only), vLLM's read-back checksums, and the log-prob parity."""
        import torch

        res: dict = {}
        if delivered is not None:  # bridge: shards equal the layouts' slicing of HF
            exp = _expected_shards(
                self.spec, Path(self.hf_dir), self.a.rollout_tp, self.vllm_tp_rank, self.scale
            )
            bad = [n for n, t in exp.items() if n in delivered and not torch.equal(delivered[n], t)]
            res["shards_checked"] = len(exp)
            res["shards_missing"] = sorted(set(exp) - set(delivered))
            res["shards_mismatched"] = bad
            res["shards_ok"] = not bad and not res["shards_missing"]
        if self.engine is not None:
            if sent_sums is not None:
                rep = compare_checksums(self.rank, sent_sums, self.engine.receiver.checksums())
                res["checksums"] = rep.to_dict()
            res["parity"] = self.parity()
        return res

    def run_direct(self, out: dict) -> None:
        """The direct bridge, ``repeats`` syncs per bucket size; the first one checked."""
        a = self.a
        for bi, bucket_mb in enumerate(a.bucket_mb):
            tr = Transport(
                self.plan, self.rank, bucket_mb=bucket_mb, timeout_s=a.timeout_s, dtype=self.dtype
            )
            reports = []
            for rep in range(a.repeats):
                reports.append(self._direct_once(tr, bi == 0 and rep == 0, out))
            out["direct"][bucket_mb] = reports
            out["bucket_memory_bytes"] = tr.bucket_memory_bytes

    def _direct_once(self, tr: Transport, verify_now: bool, out: dict) -> dict:
        import torch
        import torch.distributed as dist

        engine = self.engine
        if verify_now:
            self.scale_weights()
            if engine is not None:
                out["checks"]["parity_before_direct"] = self.parity()
        rx = None if engine is None else engine.begin_weight_update(record_checksums=verify_now)
        sink = _Sink(rx, keep=verify_now)
        finish = None if engine is None else engine.finish_weight_update
        dist.barrier()
        with torch.no_grad(), device_mode_suspended():
            st, _ = tr.run_plan(self.shards, deliver=sink, finish=finish)
        if engine is not None:
            engine.update_phases(st)
        report = SyncReport.merge(_gather_stats(st)).to_dict()
        if verify_now:
            out["checks"]["direct"] = self.check(sink.delivered, sink.sums if engine else None)
        return report

    def run_baseline(self, out: dict) -> None:
        """The anchors' gather-and-broadcast, ``repeats`` syncs; the first one checked."""
        import torch.distributed as dist

        base = BaselineSync(
            self.policy.models, self.spec, self.ctx, self.engine, padded_vocab=self.padded_vocab
        )
        out["baseline"] = []
        for rep in range(self.a.repeats):
            if rep == 0:
                self.scale_weights()
            dist.barrier()
            st = base.gather_and_broadcast()
            out["baseline"].append(SyncReport.merge(_gather_stats(st)).to_dict())
            if rep == 0 and self.engine is not None:
                out["checks"]["baseline"] = self.check(None, None)

    def run_raw(self, out: dict) -> None:
        """A raw flat transfer of the same bytes per link, ``repeats`` times."""
        import torch.distributed as dist

        a = self.a
        raw = RawTransfer(
            self.plan.bytes_per_link(), self.rank, dtype=self.dtype, timeout_s=a.timeout_s
        )
        out["raw"] = []
        for _ in range(a.repeats):
            dist.barrier()
            out["raw"].append(SyncReport.merge(_gather_stats(raw.run())).to_dict())


def bench_rank(rank: int, world: int, a: BenchSyncArgs, hf_dir: str) -> dict:
    """The body of one spawned rank: every method timed and checked; returns its figures."""
    import torch.distributed as dist

    b = RankBench(rank, world, a, hf_dir)
    out: dict = {"setup": b.setup, "direct": {}, "checks": {}}
    b.run_direct(out)
    b.run_baseline(out)
    if a.sink == "vllm-fresh":  # vLLM's own load from a fresh safetensors directory
        out["vllm_fresh"] = _fresh_load(a, b.engine, Path(hf_dir), b.scale, rank, b.policy, b.seqs)
    b.run_raw(out)
    out["minimal_bytes"] = b.plan.minimal_bytes
    out["plan"] = {"copies": len(b.plan.copies), "dst_tensors": len(b.plan.dst_tensors)}
    if b.engine is not None:
        out["weight_version"] = b.engine.weight_version
    dist.barrier()
    if b.engine is not None:  # the spawned ranks leave by os._exit: release vLLM's segments
        b.engine.shutdown()
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
