"""The judge model's process (``reward.name=judge:HF_DIR``; its settings, prompt and verdict:
``rewards/judge.py``; docs/rewards-and-data.md, "A judge model as the reward").

The run starts the judge beside the process that scores (``start_judge``): a process of its
own (``python -m megatron_grpo.rollout.judge``) holding a vLLM engine of the judge's model
(``RolloutEngine``, standalone) behind the remote-reward protocol on the loopback address
(``POST {"items": [...]}`` -> ``{"rewards": [...]}``), so the run scores it
with the remote reward's client (concurrency, time limits, retries: ``rewards/remote.py``)
and the judge's vLLM stays out of the trainer's process. Requests that arrive together are
scored in one engine call (``Batcher``), whatever ``reward.batch_size`` cut them into.
``python -m megatron_grpo.rollout.judge`` is started by ``start_judge`` only (its arguments
are the ``JudgeSpec`` as JSON).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path
from typing import Any

from megatron_grpo.distributed.spawn import TORCHRUN_ENV
from megatron_grpo.rewards.judge import JudgeSpec, expected_value, parse_verdict, render
from megatron_grpo.rewards.remote import reward_server

log = logging.getLogger(__name__)


class Judge:
    """The judge's engine and tokenizer; ``score(items)`` -> ``(rewards, unparsed)``."""

    def __init__(self, spec: JudgeSpec) -> None:
        from transformers import AutoTokenizer

        from megatron_grpo.rollout.engine import RolloutEngine

        self.spec = spec
        self.tokenizer = AutoTokenizer.from_pretrained(spec.model)
        self.engine = RolloutEngine(
            spec.model, placement="disaggregated", max_model_len=spec.max_model_len,
            cpu_kv_cache_gb=spec.cpu_kv_cache_gb,
            gpu_memory_utilization=spec.gpu_memory_utilization, seed=spec.seed,
        )  # fmt: skip
        self.choice_ids = [self.tokenizer.encode(c, add_special_tokens=False) for c in spec.choices]
        self.total_unparsed = 0

    def _prompt_ids(self, item: dict[str, Any]) -> list[int]:
        ids = self.tokenizer.encode(render(self.spec.template, item), add_special_tokens=False)
        room = self.spec.max_model_len - max(
            [self.spec.max_tokens, *(len(c) + 1 for c in self.choice_ids)]
        )
        return ids[-room:] if len(ids) > room else ids  # the verdict's end of the prompt stays

    def score(self, items: Sequence[dict[str, Any]]) -> tuple[list[float], int]:
        if not items:
            return [], 0
        prompts = [self._prompt_ids(it) for it in items]
        if not self.spec.pattern:
            seqs = [p + c for p in prompts for c in self.choice_ids]
            lps = self.engine.prompt_logprobs(seqs)
            k = len(self.choice_ids)
            out = []
            for i, p in enumerate(prompts):
                per_choice = [sum(lps[i * k + j][len(p) - 1 :]) for j in range(k)]
                out.append(expected_value(per_choice, self.spec.values))
            return out, 0
        samples = self.engine.generate(
            prompts, n=1, temperature=0.0, max_new_tokens=self.spec.max_tokens,
            seed=self.spec.seed,
        )  # fmt: skip
        texts = self.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)  # fmt: skip
        verdicts = [parse_verdict(self.spec.pattern, t) for t in texts]
        unparsed = sum(v is None for v in verdicts)
        self.total_unparsed += unparsed
        return [0.0 if v is None else v for v in verdicts], unparsed

    def shutdown(self) -> None:
        self.engine.shutdown()


class Batcher:
    """Scores the items of requests that arrive together in one ``judge.score`` call, on one
    thread (the engine's): ``submit(items)`` -> a Future of the items' rewards."""

    def __init__(self, judge: Any) -> None:
        self.judge = judge
        self._queue: queue.SimpleQueue[tuple[list[dict[str, Any]], Future]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="judge-engine", daemon=True).start()

    def submit(self, items: list[dict[str, Any]]) -> Future:
        fut: Future = Future()
        self._queue.put((items, fut))
        return fut

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            items = [it for its, _ in batch for it in its]
            try:
                rewards, unparsed = self.judge.score(items)
            except Exception as e:  # noqa: BLE001 - each request answers 500 with it
                for _, fut in batch:
                    fut.set_exception(e)
                continue
            if unparsed:
                log.warning("judge: %d of %d verdicts did not match reward.judge_pattern; "
                            "they score 0", unparsed, len(items))  # fmt: skip
            start = 0
            for its, fut in batch:
                fut.set_result(rewards[start : start + len(its)])
                start += len(its)


# ---------------------------------------------------------------------------- the process
class JudgeProcess:
    """The judge's process, started by ``start_judge``; ``url`` to POST to; ``close()``
    stops it (idempotent)."""

    def __init__(self, proc: subprocess.Popen, url: str) -> None:
        self.proc, self.url = proc, url

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_judge(cfg: Any, workdir: Path) -> JudgeProcess:
    """Start the judge of the run's config ``cfg`` (``reward.name=judge:DIR``, its ``reward.judge_*``;
    on CPU ``rollout.cpu_kv_cache_gb`` of KV cache, seeded ``seed``) in a process of its own,
    its output in ``workdir/judge.log``, and wait until it listens; RuntimeError naming the
    log when it dies or does not listen within ``parallel.timeout_s``."""
    spec = JudgeSpec.of(cfg.reward, cfg.rollout.cpu_kv_cache_gb, cfg.seed)
    timeout_s = cfg.parallel.timeout_s
    workdir.mkdir(parents=True, exist_ok=True)
    port_file, log_file = workdir / "judge.port", workdir / "judge.log"
    port_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "megatron_grpo.rollout.judge", "--spec", json.dumps(asdict(spec)),
           "--port-file", str(port_file), "--parent", str(os.getpid())]  # fmt: skip
    # A standalone engine of its own: no torchrun world, vLLM's engine core in a process.
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    with open(log_file, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env)  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while not port_file.is_file():
        if proc.poll() is not None:
            raise RuntimeError(
                f"the judge ({spec.model}) exited with code {proc.returncode} before it "
                f"listened: see {log_file}."
            )
        if time.monotonic() > deadline:
            JudgeProcess(proc, "").close()
            raise RuntimeError(
                f"the judge ({spec.model}) did not listen within {timeout_s:.0f}s "
                f"(parallel.timeout_s): see {log_file}."
            )
        time.sleep(0.2)
    return JudgeProcess(proc, f"http://127.0.0.1:{int(port_file.read_text())}/judge")


def main(argv: list[str] | None = None) -> None:
    from megatron_grpo.platform.lifetime import die_with_parent

    ap = argparse.ArgumentParser(description="The judge's process (started by the run).")
    ap.add_argument("--spec", required=True, help="JudgeSpec as JSON")
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--parent", type=int, required=True)
    a = ap.parse_args(argv)
    die_with_parent(a.parent)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    raw = json.loads(a.spec)
    spec = JudgeSpec(**{**raw, "choices": tuple(raw["choices"]), "values": tuple(raw["values"])})
    signal.signal(signal.SIGTERM, _interrupt)  # close(): stop the engine, then exit
    judge = Judge(spec)
    batcher = Batcher(judge)
    server = reward_server(lambda items: batcher.submit(items).result())
    tmp = Path(a.port_file).with_suffix(".tmp")
    tmp.write_text(str(server.server_address[1]))
    tmp.replace(a.port_file)  # whole or absent: the starter reads it once it exists
    log.info("judge %s listening on port %d", spec.model, server.server_address[1])
    try:
        server.serve_forever()
    except KeyboardInterrupt:  # SIGTERM from JudgeProcess.close
        log.info("judge stopping")
    finally:
        judge.shutdown()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()
