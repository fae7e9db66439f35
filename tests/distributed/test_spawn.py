"""``spawn_ranks`` reads its ranks' results with ``torch.load(weights_only=True)``: plain
data and the classes a caller names come back; anything else fails in the rank, naming the
type, and nothing a result holds is run in the parent (distributed/spawn.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_grpo.config import ConfigError, load_config
from megatron_grpo.distributed.placement import validate_world
from megatron_grpo.distributed.spawn import RankFailed, _load_result, ranks_needed, spawn_ranks
from megatron_grpo.rollout.samples import Sample


class _Boom:
    """Unpickling this creates ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _plain(rank: int, world: int) -> dict:
    return {"rank": rank, "t": torch.arange(3) * rank, "dtype": torch.bfloat16, "set": {1, 2},
            "tuple": (1.5, "a", None, b"raw"), "nested": [{"x": [1, 2]}]}  # fmt: skip


def _samples(rank: int, world: int) -> list[Sample]:
    return [Sample([1, 2], [3], [-0.5], "stop", str(rank))]


def _boom(rank: int, world: int, path: str) -> _Boom:
    return _Boom(path)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_plain_results_and_named_classes_come_back():
    got = spawn_ranks(_plain, 2, timeout_s=150, threads=1)
    assert [r["rank"] for r in got] == [0, 1]
    assert torch.equal(got[1]["t"], torch.tensor([0, 1, 2]))
    assert got[0]["dtype"] is torch.bfloat16 and got[0]["tuple"] == (1.5, "a", None, b"raw")
    [samples] = spawn_ranks(_samples, 1, timeout_s=150, threads=1, result_types=(Sample,))
    assert samples == [Sample([1, 2], [3], [-0.5], "stop", "0")]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_result_of_another_class_fails_in_the_rank_and_runs_nothing(tmp_path):
    with pytest.raises(RankFailed, match=r"holds megatron_grpo\.rollout\.samples\.Sample, which "
                       r"spawn_ranks does not unpickle.*result_types"):  # fmt: skip
        spawn_ranks(_samples, 1, timeout_s=150, threads=1)
    marker = tmp_path / "marker"
    with pytest.raises(RankFailed, match="holds _io.open, which spawn_ranks does not unpickle"):
        spawn_ranks(_boom, 1, str(marker), timeout_s=150, threads=1)
    assert not Path(marker).exists()


def test_the_parent_reads_a_result_file_as_data_only(tmp_path):
    """Should a rank's file hold more than its own check let through, the parent still runs
    nothing: it reads with weights_only=True and names the global it refused."""
    marker, path = tmp_path / "marker", tmp_path / "0.pt"
    torch.save({"x": _Boom(str(marker))}, path)
    with pytest.raises(RankFailed, match=r"^rank 0's result is refused by torch.load\(weights_only"
                       r"=True\): Unsupported global: GLOBAL _io.open .*result_types"):  # fmt: skip
        _load_result(path, 0, ())
    assert not marker.exists()
    torch.save([Sample([1], [2], [-0.5], "stop")], path)
    assert _load_result(path, 0, (Sample,)) == [Sample([1], [2], [-0.5], "stop")]
    with pytest.raises(RankFailed, match="GLOBAL megatron_grpo.rollout.samples.Sample"):
        _load_result(path, 0, ())


def _port_taken_once(rank: int, world: int, marker: str, message: str) -> int:
    """Fails like a rank whose rendezvous port was taken, the first time it runs."""
    path = Path(marker) / f"rank{rank}"
    if not path.exists():
        path.write_text("tried")
        raise RuntimeError(message)
    return rank


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_taken_rendezvous_port_is_retried_and_nothing_else_is(tmp_path):
    """free_port's port can be taken before rank 0 listens on it (seen in the suite: a
    ``DistNetworkError ... EADDRINUSE``); the ranks failed at their rendezvous, so the spawn
    is tried again on a fresh port. Any other failure is reported at once."""
    taken = "The server socket has failed to listen ... code: -98, name: EADDRINUSE"
    first = tmp_path / "taken"
    first.mkdir()
    assert spawn_ranks(_port_taken_once, 2, str(first), taken, timeout_s=150) == [0, 1]
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(RankFailed, match="some other failure"):
        spawn_ranks(_port_taken_once, 2, str(other), "some other failure", timeout_s=150)


def test_free_port_is_drawn_below_the_ephemeral_range(monkeypatch, tmp_path):
    """A rendezvous port outside the kernel's ephemeral range, so no bind(0) or connect of
    another job (gloo's pair listeners) takes it before rank 0 listens; drawn apart even
    under one seed; port 0's pick where the range is unknown."""
    import random
    import socket

    from megatron_grpo.distributed import spawn

    fake = tmp_path / "ip_local_port_range"
    fake.write_text("32768\t60999\n")
    monkeypatch.setattr(spawn, "EPHEMERAL_RANGE", fake)
    ports = []
    for _ in range(8):
        random.seed(0)
        ports.append(spawn.free_port())
    assert all(16384 <= p < 32768 for p in ports), ports
    assert len(set(ports)) > 1, ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # free, as promised
    monkeypatch.setattr(spawn, "EPHEMERAL_RANGE", tmp_path / "missing")
    assert 0 < spawn.free_port() < 65536


@pytest.mark.parametrize(
    "overrides, world",
    [
        ([], 1),
        (["parallel.tp=2"], 2),
        (["model.hf_path=tiny-moe", "parallel.ep=2"], 2),  # ep is carved from dp: dp=2
        (["model.hf_path=tiny-moe", "parallel.ep=4", "grpo.batch.prompts_per_step=4"], 4),
        (["model.hf_path=tiny-moe", "parallel.ep=2", "parallel.dp=2"], 2),
        (["parallel.tp=2", "rollout.tp=4", "grpo.batch.prompts_per_step=8"], 4),
    ],
)
def test_ranks_needed_is_the_least_world_the_layout_passes(overrides, world):
    """What one-process ``train`` starts: the world check passes on it, and on no fewer ranks."""
    cfg = load_config(overrides=overrides)
    assert ranks_needed(cfg) == world
    validate_world(cfg, world)
    for fewer in range(1, world):
        with pytest.raises(ConfigError):
            validate_world(cfg, fewer)
