"""A judge model as the reward (``reward.name=judge:HF_DIR``; docs/rewards-and-data.md,
"A judge model as the reward").

The run starts the judge beside the process that scores (``start_judge``): a process of its
own (``python -m megatron_grpo.rollout.judge``) holding a vLLM engine of the judge's model
(``RolloutEngine``, standalone) behind the remote-reward protocol on the loopback address
(``POST {"items": [...]}`` -> ``{"rewards": [...]}``), so the trainer scores it with the
remote reward's client (concurrency, time limits, retries: ``rewards/remote.py``) and the
judge's vLLM stays out of the trainer's process. Requests that arrive together are scored
in one engine call (``Batcher``), whatever ``reward.batch_size`` cut them into.

Each item is rendered with ``reward.judge_template`` (``{prompt}``, ``{response}``,
``{answer}``, and any key of the data row) and scored one of two ways:

- **choices** (``reward.judge_pattern`` empty, the default): the verdict is read from the
  judge's log-probs of each choice continuing the rendered prompt (``reward.judge_choices``:
  continuations, ``reward.judge_values``: their rewards); the reward is the expected value
  under the judge restricted to the choices, ``sum_c softmax(logp)_c * value_c``. Every item
  gets a verdict, from any model: nothing to parse;
- **pattern**: the judge generates up to ``reward.judge_max_tokens`` tokens greedily and the
  first group of ``reward.judge_pattern`` (a regex) in its text is the reward, a number; a
  text without a match scores 0 and is counted (``unparsed`` in the answer and the judge's
  log).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from megatron_grpo.distributed.spawn import TORCHRUN_ENV

log = logging.getLogger(__name__)

PREFIX = "judge:"
_FIELD = re.compile(r"{(\w+)}")


def is_judge(name: str) -> bool:
    """Whether ``reward.name`` names a judge model (``judge:HF_DIR``)."""
    return name.startswith(PREFIX)


@dataclass(frozen=True)
class JudgeSpec:
    """What the judge process needs (``reward.judge_*``, from the config)."""

    model: str
    template: str
    choices: tuple[str, ...]
    values: tuple[float, ...]
    pattern: str
    max_tokens: int
    max_model_len: int
    cpu_kv_cache_gb: float
    gpu_memory_utilization: float
    seed: int

    @classmethod
    def from_config(cls, cfg: Any) -> JudgeSpec:
        """``cfg``: the run's ``Config``; the judge's model is ``reward.name`` after ``judge:``."""
        r = cfg.reward
        return cls(
            model=r.name[len(PREFIX) :], template=r.judge_template,
            choices=tuple(r.judge_choices), values=tuple(float(v) for v in r.judge_values),
            pattern=r.judge_pattern, max_tokens=r.judge_max_tokens,
            max_model_len=r.judge_max_model_len, cpu_kv_cache_gb=cfg.rollout.cpu_kv_cache_gb,
            gpu_memory_utilization=r.judge_gpu_memory_utilization, seed=cfg.seed,
        )  # fmt: skip

    def check(self) -> None:
        """ValueError (one line, naming the key and the fix) for a judge that cannot run;
        cheap: before any rank or engine starts."""
        name = f"reward.name={PREFIX}{self.model}"
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(
                f"{name}: {self.model!r} has no config.json; point it at a Hugging Face model "
                "directory (the judge's weights and tokenizer)."
            )
        fields = set(_FIELD.findall(self.template))
        if "response" not in fields:
            raise ValueError(
                "reward.judge_template has no {response}: the judge would not see what it "
                "judges; write a template with {prompt}, {response} and {answer}."
            )
        if self.pattern:
            try:
                groups = re.compile(self.pattern).groups
            except re.error as e:
                raise ValueError(f"reward.judge_pattern={self.pattern!r} is not a regex ({e}).") from None  # fmt: skip
            if groups < 1:
                raise ValueError(
                    f"reward.judge_pattern={self.pattern!r} has no group: its first group is "
                    r"the reward, e.g. 'Score: ([01](?:\.\d+)?)'."
                )
        elif not self.choices or len(self.choices) != len(self.values):
            raise ValueError(
                f"reward.judge_choices={list(self.choices)} and reward.judge_values="
                f"{list(self.values)} must be as long as each other, and not empty: one reward "
                "per choice, e.g. [' yes', ' no'] and [1.0, 0.0]."
            )


def render(template: str, item: dict[str, Any]) -> str:
    """``template`` with each ``{key}`` replaced by ``item[key]`` (an unknown key stays as
    written: a template may show braces)."""
    return _FIELD.sub(lambda m: str(item.get(m.group(1), m.group(0))), template)


def expected_value(choice_logps: Sequence[float], values: Sequence[float]) -> float:
    """``sum_c softmax(logp)_c * value_c``: the choices' rewards weighted by the judge."""
    top = max(choice_logps)
    weights = [math.exp(lp - top) for lp in choice_logps]
    return sum(w * v for w, v in zip(weights, values)) / sum(weights)


def parse_verdict(pattern: str, text: str) -> float | None:
    """The number in ``pattern``'s first group in ``text``; None without one."""
    m = re.search(pattern, text)
    if m is None:
        return None
    try:
        return float(m.group(1))
    except (TypeError, ValueError):
        return None


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
    thread (the engine's): ``submit(items)`` -> a Future of ``(rewards, unparsed)``."""

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
                rewards, _ = self.judge.score(items)
            except Exception as e:  # noqa: BLE001 - each request answers 500 with it
                for _, fut in batch:
                    fut.set_exception(e)
                continue
            start = 0
            for its, fut in batch:
                fut.set_result(rewards[start : start + len(its)])
                start += len(its)


def make_handler(batcher: Batcher) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the client keeps its connections

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                items = body["items"]
                if not isinstance(items, list):
                    raise TypeError("items is not a list")
            except (ValueError, KeyError, TypeError) as e:
                return self._answer(400, {"error": f'expected {{"items": [...]}}: {e}'})
            try:
                rewards = batcher.submit(items).result()
            except Exception as e:  # noqa: BLE001 - the client retries a 5xx
                return self._answer(500, {"error": f"{type(e).__name__}: {e}"})
            self._answer(200, {"rewards": rewards})

        def _answer(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            log.debug(format, *args)

    return Handler


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


def start_judge(spec: JudgeSpec, workdir: Path, timeout_s: float) -> JudgeProcess:
    """Start the judge's process (its output in ``workdir/judge.log``) and wait until it
    listens; RuntimeError naming the log when it dies or does not listen in ``timeout_s``."""
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
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(Batcher(judge)))
    server.daemon_threads = True
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
