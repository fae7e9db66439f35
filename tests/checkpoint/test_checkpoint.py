"""Checkpoint: atomic commit, latest pointer, keep-last-N, loop state and RNG round trips
(single process), and dist_checkpointing ShardedTensors resharded between world sizes."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from megatron_grpo.checkpoint import (
    CheckpointError,
    LoopState,
    damage,
    find_intact,
    find_latest,
    list_checkpoints,
    load_checkpoint,
    read_state,
    save_checkpoint,
)
from megatron_grpo.checkpoint import core as ckpt_core
from tests.dist_utils import run_distributed


def _state(step: int, **kw) -> LoopState:
    fields = dict(
        step=step,
        data_state={"epoch": 1, "index": 8 * step, "order_seed": 7},
        policy_version=step - step % 4,
        sync_phase=step % 4,
        extra={"ref_resets": step // 10, "layout": {"tp": 2, "pp": 1}},
    )
    return LoopState(**{**fields, **kw})


def _draws() -> tuple:
    return (
        [random.random() for _ in range(3)],
        np.random.rand(3).tolist(),
        torch.rand(3).tolist(),
        torch.randint(0, 1000, (2,)).tolist(),
    )


def test_loop_state_round_trip_and_layout(tmp_path):
    path = save_checkpoint(tmp_path, _state(123), save_rng=False)
    assert path == tmp_path / "checkpoints" / "step_000123"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000123"
    assert json.loads((path / "state.json").read_text())["loop_state"]["data_state"]["index"] == 984
    for where in (tmp_path, tmp_path / "checkpoints", path):
        got = load_checkpoint(where)
        assert got.loop_state == _state(123) and got.path == path and not got.rng_restored
    assert read_state(tmp_path)["world_size"] == 1


def test_loop_state_must_be_json(tmp_path):
    with pytest.raises(ValueError, match="not JSON-able"):
        LoopState(step=1, extra={"t": torch.zeros(1)})
    with pytest.raises(ValueError, match="not JSON-able"):
        LoopState(step=1, extra={"x": float("nan")})


def test_errors_name_the_fix(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="init_distributed"):
        save_checkpoint(tmp_path, _state(1), {"model": {}})
    save_checkpoint(tmp_path, _state(1))
    with pytest.raises(CheckpointError, match=r"has no \['model'\]"):
        load_checkpoint(tmp_path, {"model": {}})
    assert load_checkpoint(tmp_path, {"ref": {}}, optional=["ref"]).state_dicts == {}
    with pytest.raises(CheckpointError, match="not usable"):
        save_checkpoint(tmp_path, _state(2), {"rng": {}})
    with pytest.raises(ValueError, match="keep_last=0"):
        save_checkpoint(tmp_path, _state(2), keep_last=0)


def test_crash_before_rename_keeps_previous(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, _state(4))

    def crash(*a, **k):
        raise KeyboardInterrupt("simulated crash between writing and renaming")

    monkeypatch.setattr(ckpt_core, "_commit", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, _state(8), keep_last=1)
    root = tmp_path / "checkpoints"
    assert (root / "step_000008.tmp" / "state.json").is_file()  # fully written, not committed
    assert (root / "latest").read_text().strip() == "step_000004"
    assert find_latest(tmp_path) == root / "step_000004"
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4]
    assert load_checkpoint(tmp_path).loop_state.step == 4  # keep_last did not prune it
    monkeypatch.undo()
    save_checkpoint(tmp_path, _state(8))
    assert not list(root.glob("*.tmp")) and find_latest(tmp_path) == root / "step_000008"


def test_crash_after_rename_before_pointer(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, _state(4))
    monkeypatch.setattr(ckpt_core, "_write_text_atomic", lambda *a: (_ for _ in ()).throw(OSError))
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, _state(8))
    # step 8 is complete, but the pointer still names step 4: resume from the pointer.
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 8]
    assert find_latest(tmp_path).name == "step_000004"
    # A stale or missing pointer falls back to the newest complete checkpoint.
    (tmp_path / "checkpoints" / "latest").write_text("step_000099\n")
    assert find_latest(tmp_path).name == "step_000008"
    (tmp_path / "checkpoints" / "latest").unlink()
    assert find_latest(tmp_path).name == "step_000008"


def test_tmp_dirs_are_ignored(tmp_path):
    save_checkpoint(tmp_path, _state(2))
    junk = tmp_path / "checkpoints" / "step_000009.tmp"
    junk.mkdir()
    (junk / "state.json").write_text("{}")
    assert find_latest(tmp_path).name == "step_000002"
    with pytest.raises(CheckpointError, match="unfinished"):
        load_checkpoint(junk)


def test_keep_last_n_and_resave(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, _state(step), keep_last=2)
        assert [s for s, _ in list_checkpoints(tmp_path)] == list(range(max(1, step - 1), step + 1))
    # A resumed run that saves an existing step again replaces it.
    save_checkpoint(tmp_path, _state(5, policy_version=1), keep_last=2)
    assert load_checkpoint(tmp_path).loop_state.policy_version == 1
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


def test_damaged_file_is_named_and_resume_falls_back_to_the_intact_one(tmp_path):
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, _state(step))
    root = tmp_path / "checkpoints"
    rng = root / "step_000006" / "rng" / "rank_00000.pt"
    assert damage(root / "step_000006") is None
    rng.write_bytes(rng.read_bytes()[:-7])  # truncated
    assert f"{rng} has" in damage(root / "step_000006") and "truncated" in damage(rng.parents[1])
    with pytest.raises(CheckpointError, match=r"step_000006 is damaged: .*rank_00000\.pt"):
        load_checkpoint(tmp_path)
    data = bytearray((root / "step_000004" / "rng" / "rank_00000.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped bit
    (root / "step_000004" / "rng" / "rank_00000.pt").write_bytes(bytes(data))
    assert "checksum" in damage(root / "step_000004")
    found, skipped = find_intact(tmp_path)
    assert found == root / "step_000002"
    assert [s.split(" is damaged")[0] for s in skipped] == [
        "checkpoint step_000006", "checkpoint step_000004"
    ]  # fmt: skip
    (root / "step_000002" / "rng" / "rank_00000.pt").unlink()
    assert "is missing" in damage(root / "step_000002")
    (root / "step_000002" / "state.json").write_text("{not json")
    assert "unreadable" in damage(root / "step_000002")
    with pytest.raises(CheckpointError, match="state.json is damaged"):
        load_checkpoint(root / "step_000002")
    found, skipped = find_intact(tmp_path)
    assert found is None and len(skipped) == 3 and "step_000002 is damaged" in skipped[2]


def test_rng_round_trip(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draws()
    save_checkpoint(tmp_path, _state(10))
    uninterrupted = _draws()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    _draws()
    got = load_checkpoint(tmp_path)
    assert got.rng_restored
    assert _draws() == uninterrupted
    # Stored without pickled objects: loads with weights_only.
    state = torch.load(got.path / "rng" / "rank_00000.pt", weights_only=True)
    assert set(state) >= {"python", "numpy", "torch"}


# -- distributed: dist_checkpointing ShardedTensors across world sizes ---------------------
ROWS, COLS = 8, 6


def _full(name: str) -> torch.Tensor:
    base = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    return {"col_parallel": base, "row_parallel": base.T.contiguous() + 1000, "norm": base[0] * 7}[
        name
    ]


def _sharded(rank: int, world: int, fill: bool) -> dict:
    """Rank's shard templates: column-parallel (dim 0), row-parallel (dim 1), replicated."""
    from megatron.core.dist_checkpointing import ShardedTensor

    def local(name: str, dim: int | None) -> torch.Tensor:
        full = _full(name)
        t = full if dim is None else full.chunk(world, dim)[rank]
        return t.clone() if fill else torch.zeros_like(t)

    return {
        "model": {
            "w1": ShardedTensor.from_rank_offsets("w1", local("col_parallel", 0), (0, rank, world)),
            "w2": ShardedTensor.from_rank_offsets("w2", local("row_parallel", 1), (1, rank, world)),
            "norm": ShardedTensor.from_rank_offsets("norm", local("norm", None), replica_id=rank),
        },
        "optimizer": {"param_groups": [{"lr": 1e-5, "step": 3}]},  # common (non-sharded) state
    }


def _init(rank: int, world: int) -> None:
    from megatron_grpo.platform.cpu import apply_cpu_platform

    apply_cpu_platform()  # dist_checkpointing calls torch.cuda.synchronize / current_device
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)


def _check_loaded(rank: int, world: int, sd: dict) -> None:
    m = sd["model"]
    torch.testing.assert_close(m["w1"], _full("col_parallel").chunk(world, 0)[rank], rtol=0, atol=0)
    torch.testing.assert_close(m["w2"], _full("row_parallel").chunk(world, 1)[rank], rtol=0, atol=0)
    torch.testing.assert_close(m["norm"], _full("norm"), rtol=0, atol=0)
    assert sd["optimizer"]["param_groups"][0]["step"] == 3


def _wait_for(run_dir: str, step: int, timeout: float = 100.0) -> None:
    deadline = time.monotonic() + timeout
    while (latest := find_latest(run_dir)) is None or latest.name != f"step_{step:06d}":
        if time.monotonic() > deadline:
            raise TimeoutError(f"checkpoint step {step} did not appear in {run_dir}")
        time.sleep(0.1)


def _dist_world1(rank: int, world: int, run_dir: str) -> tuple:
    """World 1: save step 1 and draw on (the uninterrupted run); once the world-2 group has
    saved step 2, load it (2 -> 1 reshard), restore step 1's RNG and draw again."""
    _init(rank, world)
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    tracker.add("model-parallel-rng", 1234)
    torch.manual_seed(5)
    save_checkpoint(run_dir, _state(1), {"model": _sharded(rank, world, fill=True)})
    with tracker.fork():
        uninterrupted = (_draws(), torch.rand(3).tolist())

    _wait_for(run_dir, 2)
    got = load_checkpoint(run_dir, {"model": _sharded(rank, world, fill=False)})
    assert got.path.name == "step_000002" and got.saved_world_size == 2
    assert got.loop_state == _state(2) and not got.rng_restored  # saved by 2 ranks
    _check_loaded(rank, world, got.state_dicts["model"])

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    tracker.reset()
    tracker.add("model-parallel-rng", 999)
    assert load_checkpoint(f"{run_dir}/checkpoints/step_000001").rng_restored
    with tracker.fork():
        resumed = (_draws(), torch.rand(3).tolist())
    torch.distributed.destroy_process_group()
    return uninterrupted, resumed


def _dist_world2(rank: int, world: int, run_dir: str) -> bool:
    """World 2: load step 1 (saved by 1 rank, 1 -> 2 reshard), then save step 2."""
    _init(rank, world)
    _wait_for(run_dir, 1)
    got = load_checkpoint(run_dir, {"model": lambda: _sharded(rank, world, fill=False)})
    _check_loaded(rank, world, got.state_dicts["model"])
    assert got.loop_state == _state(1) and not got.rng_restored  # world size changed
    save_checkpoint(run_dir, _state(2), {"model": _sharded(rank, world, fill=True)}, keep_last=2)
    torch.distributed.destroy_process_group()
    return True


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sharded_reshard_between_world_sizes(tmp_path):
    """Save at world 1 -> load at world 2 -> save at world 2 -> load at world 1.

    The two process groups run concurrently (each waits for the other's checkpoint), so the
    expensive megatron imports overlap.
    """
    run_dir = str(tmp_path)
    with ThreadPoolExecutor(2) as pool:
        one = pool.submit(run_distributed, _dist_world1, 1, run_dir, timeout=150)
        two = pool.submit(run_distributed, _dist_world2, 2, run_dir, timeout=150)
        assert two.result() == [True, True]
        ((uninterrupted, resumed),) = one.result()
    assert resumed == uninterrupted  # python, numpy, torch and megatron tracker streams
    step2 = tmp_path / "checkpoints" / "step_000002"
    assert sorted(p.name for p in (step2 / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]
    assert (step2 / "model" / "metadata.json").is_file()
