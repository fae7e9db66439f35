"""The colocated memory dance, in the loop's real order: ``GRPOTrainer.run`` drives a fake
vLLM engine and fake trainer offloads (sleep mode is CUDA-only), and every call is recorded
through steps with and without a weight sync and with a checkpoint save; the config keys
map to the dance they promise, and on CPU nothing is called at all."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_grpo.config import Config, ConfigError
from megatron_grpo.config.loader import load_config
from megatron_grpo.dry_run.budget import resolve_token_budget
from megatron_grpo.metrics import PhaseTimer
from megatron_grpo.trainer import checkpointer as checkpointer_module
from megatron_grpo.trainer import loop
from megatron_grpo.trainer.build import window_buffer
from megatron_grpo.trainer.checkpointer import Checkpointer
from megatron_grpo.trainer.colocated_memory import ColocatedMemory
from megatron_grpo.trainer.sync_schedule import SyncSchedule


class FakeEngine:
    def __init__(self, calls):
        self.calls = calls

    def sleep(self, level):
        self.calls.append(f"vllm.sleep({level})")

    def wake_up(self, tags=None):
        self.calls.append(f"vllm.wake({','.join(tags)})")


class FakeOffload:
    def __init__(self, name, calls):
        self.name, self.calls, self.offloaded = name, calls, False

    def offload(self):
        if not self.offloaded:
            self.calls.append(f"{self.name}.offload")
        self.offloaded = True

    def reload(self):
        if self.offloaded:
            self.calls.append(f"{self.name}.reload")
        self.offloaded = False


def _trainer(cfg: Config, memory: ColocatedMemory, calls: list, monkeypatch) -> loop.GRPOTrainer:
    """A GRPOTrainer built from fakes that record themselves; ``run``, ``push_weights``, the batch
    source (``build.window_buffer``) and the checkpointer are the real ones."""

    class StepTimer(PhaseTimer):
        def reset(self):  # run() resets the timer as each step begins
            calls.append("begin")
            super().reset()

    def rec(name, ret=None):
        def f(*args, **kwargs):
            calls.append(name)
            return ret

        return f

    class Prompts:
        def next_batch(self, n):
            return [SimpleNamespace(prompt_ids=[1])] * n

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            calls.append(f"data at {state}")

    class Rollout:
        def launch(self, steps, **sampling):
            calls.append("generate")
            return [lambda: [] for _ in steps]

        def share(self, fn):
            return fn()

    ctx = SimpleNamespace(rank=0, world_size=1, tp=1, cp=1, pp=1, dp=1)
    policy = SimpleNamespace(sharded_state_dict=lambda *a: {})
    checkpointer = Checkpointer("unused", cfg.checkpoint, cfg.steps, ctx, policy, None, None,
                                memory, 60.0, SimpleNamespace(agreed=lambda ctx: False))  # fmt: skip
    t = loop.GRPOTrainer(
        cfg=cfg, ctx=ctx, tokenizer=SimpleNamespace(pad_token_id=0), policy=policy, ref=None,
        rollout=Rollout(), sender=SimpleNamespace(syncs=0, push=rec("sync")),
        window=window_buffer(cfg, Prompts(), Rollout(), memory, eos_token_id=0,
                             score=lambda prompts, samples: (torch.zeros(1, 2), {})),
        advantage_fn=None,
        loss_fn=SimpleNamespace(needs=frozenset()), memory=memory, checkpointer=checkpointer,
        schedule=SyncSchedule.from_config(cfg.sync),
        budget=resolve_token_budget(None, cfg, dp=1, colocated=True, capacity_bytes=None),
        logger=SimpleNamespace(log=lambda step: calls.append(f"log {step}")), timer=StepTimer(),
    )  # fmt: skip
    t.logprobs = SimpleNamespace(reference=rec("logprobs", (None, None)))
    t.group_advantages = lambda *a: None
    t.train_on = rec("train", ([], None, None))  # (metrics, drift, ratio parts)
    t.finish = lambda: {"preempted": False}
    monkeypatch.setattr(loop, "collate", lambda samples, pad: {})
    monkeypatch.setattr(loop, "step_row", lambda step, *a, **k: step)

    def fake_save(run_dir, state, parts, keep_last):
        resident = [o.name for o in (memory.state, memory.weights) if o and not o.offloaded]
        calls.append(f"save {state.step} resident={'+'.join(resident)}")
        return "ckpt"

    monkeypatch.setattr(checkpointer_module, "save_checkpoint", fake_save)
    return t


def _dance(monkeypatch, sleep_level=1, offload_weights=True, overrides=()):
    cfg = load_config(
        None,
        ["steps=4", "sync.interval=2", "checkpoint.interval=3", "checkpoint.keep_last=1",
         *overrides],
    )  # fmt: skip
    calls: list[str] = []
    memory = ColocatedMemory(
        FakeEngine(calls),
        FakeOffload("state", calls),
        FakeOffload("weights", calls) if offload_weights else None,
        sleep_level=sleep_level,
        empty_cache=lambda: calls.append("empty_cache"),
        memory=lambda: None,
    )
    _trainer(cfg, memory, calls, monkeypatch).run()
    steps: list[list[str]] = []
    for c in calls:
        if c == "begin":
            steps.append([])
        elif steps:
            steps[-1].append(c)
    return steps


def test_loop_order_sleep_and_offload(monkeypatch):
    s1, s2, s3, s4 = _dance(monkeypatch)
    # Step 1: the engine starts awake; the trainer's state leaves before the first generate.
    assert s1 == [
        "state.offload", "weights.offload", "empty_cache", "generate",
        "vllm.sleep(1)", "empty_cache", "weights.reload", "state.reload",
        "logprobs", "train",
        "log 1",  # no sync at step 1 (v=2): vLLM sleeps on until the next generate
    ]  # fmt: skip
    # Step 2: vLLM's weights and KV cache wake for the generate; its weights wake again
    # for the sync (the optimizer state leaves first).
    assert s2 == [
        "state.offload", "weights.offload", "empty_cache", "vllm.wake(weights)",
        "vllm.wake(kv_cache)", "generate",
        "vllm.sleep(1)", "empty_cache", "weights.reload", "state.reload",
        "logprobs", "train",
        "state.offload", "empty_cache", "vllm.wake(weights)", "sync",
        "log 2",
    ]  # fmt: skip
    # Step 3 saves a checkpoint after logging it (a checkpoint is never newer than the log),
    # the trainer's state resident since the generate.
    assert s3[s3.index("train") + 1 :] == ["log 3", "save 3 resident=state+weights"]
    # Step 4 syncs, so the optimizer state comes back for the save, then leaves.
    assert s4[-6:] == [
        "vllm.wake(weights)", "sync", "log 4", "state.reload", "save 4 resident=state+weights",
        "state.offload",
    ]  # fmt: skip


def test_the_initial_sync_makes_no_memory_turn(monkeypatch):
    """``GRPOTrainer.start`` pushes the starting weights through ``push_weights`` without
    ``before_sync``: the engine starts awake and the trainer's state stays resident until
    step 1's generate (its offload is step 1's first call, above)."""
    cfg = load_config(None, ["steps=4", "sync.interval=2"])
    calls: list[str] = []
    memory = ColocatedMemory(
        FakeEngine(calls), FakeOffload("state", calls), FakeOffload("weights", calls),
        empty_cache=lambda: calls.append("empty_cache"), memory=lambda: {"allocated_gib": 0.0},
    )  # fmt: skip
    t = _trainer(cfg, memory, calls, monkeypatch)
    t.start()
    assert (calls, t.policy_version, memory.take_boundaries()) == (["sync"], 0, None)
    # A resume: the data stream continues from the checkpoint's position, vLLM serves the
    # checkpoint's served weights as version 2, the schedule counts from that push.
    from megatron_grpo.checkpoint import LoopState

    t = _trainer(cfg, memory, calls, monkeypatch)
    calls.clear()
    t.start((LoopState(step=3, data_state={"pos": 3}, policy_version=2), t.policy))
    assert calls == ["data at {'pos': 3}", "sync"]
    assert (t.start_step, t.policy_version, t.schedule.policy_version) == (3, 2, 2)


def test_colocated_window_wakes_vllm_once(monkeypatch):
    """rollout.ahead = v-1: one generate per sync window, so vLLM wakes once per window."""
    s1, s2, s3, s4 = _dance(monkeypatch, overrides=["rollout.ahead=1"])
    assert s1.count("generate") == 1 and "generate" not in s2
    assert not any(c.startswith("vllm.wake") for c in s1)  # a new engine is awake
    assert s2[s2.index("train") + 1 :] == [
        "state.offload", "empty_cache", "vllm.wake(weights)", "sync", "log 2",
    ]  # fmt: skip
    assert s3.count("generate") == 1 and "generate" not in s4
    assert s3[:4] == ["weights.offload", "empty_cache", "vllm.wake(kv_cache)", "generate"]


def test_loop_order_level2_without_weight_offload(monkeypatch):
    s1, s2, _, _ = _dance(monkeypatch, sleep_level=2, offload_weights=False)
    assert "vllm.sleep(2)" in s1 and not any(c.startswith("weights.") for c in s1 + s2)
    assert s2[:5] == [
        "state.offload", "empty_cache", "vllm.wake(weights)", "vllm.wake(kv_cache)", "generate",
    ]  # fmt: skip


def test_nothing_is_called_on_cpu_or_disaggregated(monkeypatch):
    calls: list[str] = []
    policy = SimpleNamespace(trainable=True)
    for placement, device in (("colocated", "cpu"), ("disaggregated", "cuda")):
        cfg = load_config(None, [f"rollout.placement={placement}"])
        mem = ColocatedMemory.from_config(cfg, FakeEngine(calls), policy, torch.device(device))
        assert not mem.active
        mem._empty_cache = lambda: calls.append("empty_cache")
        for hook in (mem.before_generate, mem.after_generate, mem.before_sync):
            hook()
    assert calls == []


@pytest.mark.parametrize(
    "overrides, level, state, weights",
    [
        ([], 1, True, False),
        (["rollout.trainer_offload=all"], 1, True, True),
        (["rollout.trainer_offload=none", "rollout.sleep_between_rollouts=false"], 0, False, False),
        (["rollout.sleep_level=2", "sync.interval=1"], 2, True, False),
    ],
)
def test_config_keys_map_to_the_dance(overrides, level, state, weights):
    cfg = load_config(None, overrides)
    policy = SimpleNamespace(trainable=True)
    mem = ColocatedMemory.from_config(cfg, object(), policy, torch.device("cuda"))
    assert (mem.sleep_level, mem.state is not None, mem.weights is not None) == (
        level,
        state,
        weights,
    )


def test_level2_needs_a_sync_every_step():
    with pytest.raises(ConfigError, match=r"sleep_level=2 .* sync.interval=4"):
        load_config(None, ["rollout.sleep_level=2"])
    with pytest.raises(ConfigError, match="rollout.sleep_level=3"):
        load_config(None, ["rollout.sleep_level=3"])


def test_memory_is_recorded_at_each_phase_boundary(tmp_path):
    from megatron_grpo.config.schema import LoggingConfig
    from megatron_grpo.metrics import MetricsLogger, StepMetrics

    counter = iter(range(100))
    mem = ColocatedMemory(
        None, sleep_level=0, memory=lambda: {"allocated_gib": float(next(counter))}
    )
    mem.before_generate()
    mem.after_generate()
    mem.before_sync()
    snaps = mem.take_boundaries()
    assert list(snaps) == ["rollout_start", "rollout_end", "train_start", "train_end", "sync_start"]
    assert [s["allocated_gib"] for s in snaps.values()] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert mem.take_boundaries() is None  # a fresh record per step
    logger = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False, progress=False), 1, 0)
    row = logger.log(StepMetrics(step=1, gpu_memory=snaps))
    logger.close()
    assert row["gpu_memory"]["train_end"] == {"allocated_gib": 3.0}
