"""GPU-path decisions that are pure functions, checked on CPU: which GPUs a disaggregated
engine takes, the context-parallel refusal, and sequence-parallel micro-batch padding."""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.config.schema import ConfigError, ParallelConfig
from megatron_grpo.policy.micro_batches import micro_batches as _micro_batches
from megatron_grpo.rollout.server import engine_devices
from tests.helpers.batches import advantaged


@pytest.mark.parametrize(
    "visible,local_rank,tp,count,expect",
    [
        (None, 0, 2, 8, "0,1"),
        (None, 4, 2, 8, "4,5"),
        # Slurm hands the job GPUs 4..7 of the node: engine on local rank 2 gets 6,7, not 2,3.
        ("4,5,6,7", 2, 2, 8, "6,7"),
        ("4,5,6,7", 0, 4, 8, "4,5,6,7"),
        ("GPU-a, GPU-b,GPU-c", 1, 1, 3, "GPU-b"),
    ],
)
def test_engine_devices_pick_the_engines_own_gpus(visible, local_rank, tp, count, expect):
    assert engine_devices(visible, local_rank, tp, count) == expect


def test_engines_of_one_node_never_share_a_gpu():
    visible = "8,9,10,11,12,13,14,15"
    tp = 2
    taken = [engine_devices(visible, lr, tp, 16).split(",") for lr in range(0, 8, tp)]
    flat = [g for gpus in taken for g in gpus]
    assert sorted(flat, key=int) == visible.split(",")


def test_engine_devices_refuse_too_few_visible_gpus():
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=2 needs GPUs \[2, 4\).*sees 3"):
        engine_devices("0,1,2", 2, 2, 8)


def test_context_parallel_is_refused_where_it_does_not_run_yet():
    from megatron_grpo.config.schema import Config, KernelsConfig, ModelConfig

    ParallelConfig(cp=2)  # the layout alone is fine: the world check divides it out
    Config(parallel=ParallelConfig(cp=2))
    Config(parallel=ParallelConfig(cp=2, pp=2))
    Config(parallel=ParallelConfig(cp=2, ep=2))  # experts run with CP (issue 42)
    Config(parallel=ParallelConfig(cp=2, tp=2, sequence_parallel=True))  # and with SP
    with pytest.raises(ConfigError, match=r"packed_rope=false: set true .* or parallel.cp=1"):
        Config(
            parallel=ParallelConfig(cp=2),
            model=ModelConfig(kernels=KernelsConfig(packed_rope=False)),
        )


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_pads_micro_batches_to_a_multiple_of_tp(tp):
    b, seq = 5, 7
    ids = torch.arange(1, b * seq + 1).view(b, seq)
    am = torch.ones(b, seq, dtype=torch.long)
    am[0, 3:] = 0  # first micro-batch trims to 3 (rows 0-1), the rest keep all 7
    am[1, 3:] = 0
    batch = advantaged(ids, attention_mask=am, loss_mask=am.float(), advantages=torch.ones(b))
    for rows, length, mb in _micro_batches(batch, 2, multiple=tp):
        n = mb.input_ids.shape[1]
        assert n % tp == 0 and length <= n < length + tp
        real = min(n, seq)
        assert torch.equal(mb.input_ids[:, :real], ids[rows, :real])
        assert not mb.input_ids[:, seq:].any() and not mb.loss_mask[:, seq:].any()
        assert mb.loss_mask.shape == mb.input_ids.shape
        assert mb.advantages.shape == (rows.stop - rows.start,)
    # Without sequence parallelism nothing is padded.
    lengths = [mb.input_ids.shape[1] for _, _, mb in _micro_batches(batch, 2)]
    assert lengths == [3, 7, 7]


def test_phase_timer_synchronizes_the_cuda_device_only():
    from megatron_grpo.metrics.timer import PhaseTimer

    assert PhaseTimer.for_device(torch.device("cpu"))._sync is None
    sync = PhaseTimer.for_device(torch.device("cuda", 3))._sync
    assert sync.func is torch.cuda.synchronize and sync.args == (torch.device("cuda", 3),)
