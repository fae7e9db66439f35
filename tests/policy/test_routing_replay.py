"""Routing replay (issue 32, docs/moe.md "Routing replay"): vLLM's routed experts captured
on the CPU engine, carried in the batch, and replayed by megatron's MoE routers.

The end-to-end test runs one colocated tiny-moe engine and the trainer's policy in one
spawned process. It reads the experts the trainer's MoE layers actually used from the
routers' own output (``TopKRouter.forward``'s routing map, what the token dispatcher
receives), not from the replay code.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_grpo.config import Config, ConfigError
from megatron_grpo.config.loader import load_config
from tests.dist_utils import run_distributed
from tests.helpers.bridge import ENGINE_KW
from tests.helpers.layouts import moe_spec

PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [20, 21, 22]]


def _used_experts(policy) -> tuple[list, list]:
    """Forward hooks on every router: each call's top-k sets, as a bool [tokens, E] map."""
    from megatron.core.transformer.moe.router import TopKRouter

    seen: list = []
    handles = [
        m.register_forward_hook(lambda mod, inp, out, layer=m.layer_number - 1: seen.append(
            (layer, out[1].detach().bool().cpu())))
        for model in policy.models for m in model.modules() if isinstance(m, TopKRouter)
    ]  # fmt: skip
    return seen, handles


def _as_map(routed: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[tokens, k] expert ids (-1: none) -> (bool [tokens, E] map, valid [tokens])."""
    valid = routed[:, 0] >= 0
    m = torch.zeros(routed.shape[0], experts, dtype=torch.bool)
    m[valid] = torch.zeros(int(valid.sum()), experts).scatter_(1, routed[valid].long(), 1).bool()
    return m, valid


def _expected(batch, packed: bool) -> torch.Tensor:
    """vLLM's experts in the router's token order: [L, n] flattened, or the rows packed."""
    r = batch.routed_experts
    if not packed:
        return r.transpose(0, 1).reshape(-1, *r.shape[2:])
    lengths = batch.attention_mask.sum(1).long().tolist()
    return torch.cat([r[i, :n] for i, n in enumerate(lengths)])


def _replay_worker(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    from megatron_grpo.config.schema import ModelConfig, OptimConfig, ParallelConfig
    from megatron_grpo.distributed import init_distributed
    from megatron_grpo.layouts.io import load_hf_into_megatron
    from megatron_grpo.models.spec import load_spec
    from megatron_grpo.models.tiny import build_hf_model
    from megatron_grpo.policy.policy import build_policy
    from megatron_grpo.rollout import RolloutEngine
    from megatron_grpo.trainer.collate import collate

    dist.init_process_group("gloo", rank=rank, world_size=world)
    hf = build_hf_model(Path(root) / "tiny_moe", preset="tiny-moe", seed=1)
    spec = load_spec(hf)
    eng = RolloutEngine(hf, tp=1, routing_capture=True, **ENGINE_KW)
    samples = eng.generate(PROMPTS, n=2, max_new_tokens=6, seed=7)
    eng.shutdown()
    batch = collate(samples, pad_id=0)
    ctx = init_distributed(ParallelConfig(backend="gloo"), spec)
    policy = build_policy(
        spec, ctx, ModelConfig(hf_path=str(hf), dtype="float32"), OptimConfig(lr=1e-3),
        init_weights=lambda chunks: load_hf_into_megatron(chunks, hf, spec, ctx),
        routing_replay=True,
    )  # fmt: skip
    out: dict = {"rows": [tuple(s.routed_experts.shape) for s in samples], "batch": batch}
    seen, _ = _used_experts(policy)
    slots = policy.routing.slots

    def run(replay: bool, budget: int | None = None) -> torch.Tensor:
        for s in slots:
            s.replay = replay
        seen.clear()
        logp = policy.compute_logprobs(batch, len(samples), token_budget=budget)["logp"]
        out.setdefault("used", []).append((replay, budget is not None, list(seen)))
        return logp

    # the trainer holds vLLM's weights: its routers agree with vLLM's (the alignment check)
    run(False)
    out["mismatch_same_weights"] = policy.routing.take_mismatch()
    # perturbed routers: many routings differ; replay must still use vLLM's experts
    with torch.no_grad():
        for name, p in policy.models[0].named_parameters():
            if name.endswith("mlp.router.weight"):
                p.add_(torch.randn_like(p), alpha=float(p.abs().mean()) * 3)
    out["logp_off"] = run(False)
    out["mismatch_perturbed"] = policy.routing.take_mismatch()
    out["logp_on"] = run(True)
    out["logp_on_packed"] = run(True, budget=10_000)
    out["mismatch_replayed"] = policy.routing.take_mismatch()  # the router's own choice
    seen.clear()
    policy.train_step(batch, lambda lp, ent, mb: (-(lp * mb.response_mask).sum(), {}), len(samples))
    out["used"].append((True, False, list(seen)))
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_replay_routes_the_trainer_to_vllms_experts(tmp_path: Path) -> None:
    """With routing replay the trainer's MoE layers (log-prob pass, padded and packed, and a
    train step) route every token vLLM forwarded to exactly vLLM's experts, although its
    routers were perturbed; without replay, log-probs differ from the replayed ones only
    after the first token whose routing differs."""
    from megatron_grpo.algorithms.step_batch import SampledBatch

    out = run_distributed(
        _replay_worker, 1, str(tmp_path), timeout=380.0, result_types=(SampledBatch,)
    )[0]
    batch, experts = out["batch"], 4  # tiny-moe
    lengths = batch.attention_mask.sum(1).long().tolist()
    assert out["rows"] == [(n - 1, 2, 2) for n in lengths]  # prompt + response - 1, layers, k
    assert out["mismatch_same_weights"] == 0.0  # fp32 CPU: vLLM and megatron route alike
    assert out["mismatch_perturbed"] > 0.2 and out["mismatch_replayed"] > 0.2
    # runs: same weights (off), perturbed off, on, on packed, a train step (on)
    for run, (_, packed, seen) in enumerate(out["used"]):
        expected = _expected(batch, packed)
        assert sorted(layer for layer, _ in seen) == [0, 1]  # one micro-batch, two layers
        agree = []
        for layer, used in seen:
            want, valid = _as_map(expected[:, layer], experts)
            assert used.shape == want.shape
            agree.append(bool((used[valid] == want[valid]).all()))
        assert all(agree) == (run != 1), (run, agree)
    # logp[t] depends on the routing of tokens < t: equal up to each row's first difference
    r = batch.routed_experts
    off, on = out["logp_off"], out["logp_on"]
    torch.testing.assert_close(out["logp_on_packed"], on, atol=1e-5, rtol=0)
    own = [u for _, u in sorted(out["used"][1][2], key=lambda x: x[0])]  # perturbed, no replay
    n, length = r.shape[:2]
    differs = torch.zeros(n, length, dtype=torch.bool)
    for layer, used in enumerate(own):
        want, valid = _as_map(r[:, :, layer].transpose(0, 1).reshape(-1, 2), experts)
        diff = (valid & ~(used == want).all(1)).view(length, n).t()
        differs |= diff
    first = torch.where(differs.any(1), differs.float().argmax(1), torch.full((n,), length))
    changed = 0
    for i in range(n):
        f = int(first[i])
        torch.testing.assert_close(on[i, : f + 1], off[i, : f + 1], atol=1e-5, rtol=0)
        changed += int(((on[i, f + 1 :] - off[i, f + 1 :]).abs() > 1e-4).sum())
    assert changed > 0


# ------------------------------------------------------------------------- refusals
def test_routing_replay_values(tmp_path: Path) -> None:
    """YAML's on/off (booleans in YAML 1.1) are the modes; anything else is one line."""
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("rollout:\n  routing_replay: on\n")
    assert load_config(cfg_file).rollout.routing_replay == "on"
    assert load_config(None, ["rollout.routing_replay=off"]).rollout.routing_replay == "off"
    assert load_config(None, ["rollout.routing_replay=measure"]).rollout.routing_replay == "measure"
    with pytest.raises(ConfigError, match=r"rollout.routing_replay='yes please' is not one of"):
        load_config(None, ["rollout.routing_replay=yes please"])


def test_routing_replay_needs_an_moe_model() -> None:
    import dataclasses

    from megatron_grpo.trainer.preflight import check_moe

    cfg = load_config(None, ["rollout.routing_replay=on"])
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model") as e:
        check_moe(dataclasses.replace(moe_spec(), num_experts=0, moe_topk=0), cfg)
    assert "\n" not in str(e.value)
    check_moe(moe_spec(), cfg)  # an MoE model replays
    cfg = load_config(None, ["rollout.routing_replay=measure", "model.recompute=full"])
    with pytest.raises(ConfigError, match="model.recompute=full"):
        check_moe(moe_spec(), cfg)
    assert Config().rollout.routing_replay == "off"


# ------------------------------------------------------------------------- the pieces
def test_capture_files_rows_by_position_and_keys_samples() -> None:
    """A request's rows are assembled by position (a recompute after preemption overwrites);
    a position never forwarded is an error; vLLM's internal ids map back to (request, n)."""
    import numpy as np

    from megatron_grpo.rollout.routing_capture import RoutingCapture, sample_key

    cap = object.__new__(RoutingCapture)
    rows = lambda v, n: np.full((n, 2, 2), v, dtype=np.int32)  # noqa: E731
    cap.rows = {"0_3-ab12cd34": [(0, rows(1, 5)), (5, rows(2, 1)), (3, rows(7, 3))]}
    got = cap.take()["0_3-ab12cd34"]
    assert got.dtype == np.uint8 and got[:, 0, 0].tolist() == [1, 1, 1, 7, 7, 7]
    assert cap.rows == {}
    cap.rows = {"5-ffffffff": [(0, rows(1, 2)), (3, rows(1, 1))]}
    with pytest.raises(RuntimeError, match="position 2 was never forwarded"):
        cap.take()
    assert sample_key("1_12-0a1b2c3d") == ("12", 1)
    assert sample_key("12-0a1b2c3d") == ("12", 0)


def test_slot_replays_targets_with_the_routers_own_scores() -> None:
    """Targets replace the router's top-k, scored by its own scores at them; -1 rows keep
    its choice; both modes count the routings whose expert set differs; under sequence
    parallelism each TP rank takes its share of the sequence."""
    from megatron_grpo.policy.routing_replay import RoutingReplay, RoutingSlot

    def topk(scores, k, num_groups=None, group_topk=None):
        return torch.topk(scores, k=k, dim=1)

    scores = torch.tensor([[0.1, 0.9, 0.5, 0.0], [0.8, 0.1, 0.2, 0.7], [0.3, 0.2, 0.1, 0.4]])
    slot = RoutingSlot(layer=1, replay=True)
    slot.target = torch.tensor([[2, 0], [3, 0], [-1, -1]])  # row 1: the same set, reordered
    probs, idx = slot.get_replay_topk(scores, 2, default_compute_topk=topk)
    assert idx.tolist() == [[2, 0], [3, 0], [3, 0]]
    assert torch.equal(probs, torch.tensor([[0.5, 0.1], [0.7, 0.8], [0.4, 0.3]]))
    assert slot.counts.tolist() == [1, 2]
    slot.replay = False
    _, idx = slot.get_replay_topk(scores, 2, default_compute_topk=topk)
    assert idx.tolist() == [[1, 2], [0, 3], [3, 0]]
    replay = RoutingReplay([slot], tp_rank=1, sp_size=2)
    assert replay.take_mismatch() == 2 / 4 and replay.take_mismatch() is None
    routed = torch.arange(2 * 4 * 2 * 2).view(2, 4, 2, 2)  # [n, L, layers, k]
    replay.set_targets(routed, packed=False)  # sequence-major, rank 1's half: t = 2, 3
    assert slot.target.tolist() == [routed[i, t, 1].tolist() for t in (2, 3) for i in (0, 1)]
    replay.set_targets(None, packed=False)
    assert slot.target is None


def test_batch_and_pack_carry_the_experts_position_aligned() -> None:
    """collate puts sample i's row t at [i, t] (-1 for the last token and padding); a pack
    concatenates each row's first len tokens like the tokens (-1 for the filler)."""
    import dataclasses

    import numpy as np

    from megatron_grpo.policy.micro_batches import packed_micro_batches
    from megatron_grpo.rollout.samples import Sample
    from megatron_grpo.trainer.collate import collate

    def sample(p: int, r: int, base: int) -> Sample:
        rows = np.arange(base, base + (p + r - 1) * 2, dtype=np.uint8).reshape(-1, 1, 2)
        return Sample(list(range(1, p + 1)), [7] * r, [-0.5] * r, "stop", routed_experts=rows)

    batch = collate([sample(3, 2, 0), sample(2, 1, 100)], pad_id=0)
    r = batch.routed_experts
    assert r.shape == (2, 5, 1, 2) and r.dtype == torch.int16
    assert r[0, :4, 0].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]] and r[0, 4].tolist() == [
        [-1, -1]
    ]
    assert r[1, :2, 0].tolist() == [[100, 101], [102, 103]] and (r[1, 2:] == -1).all()
    (_, _, _, pack), = packed_micro_batches(batch, token_budget=100, multiple=5)  # fmt: skip
    assert pack.input_ids.shape[1] == 10 and pack.routed_experts.shape == (10, 1, 2)
    assert torch.equal(pack.routed_experts[:5], r[0]) and torch.equal(
        pack.routed_experts[5:8], r[1, :3]
    )
    assert (pack.routed_experts[8:] == -1).all()  # the filler document
    assert set(pack.tensors()) >= {"input_ids", "routed_experts"}
    dense = dataclasses.replace(batch, routed_experts=None)
    assert "routed_experts" not in packed_micro_batches(dense, 100)[0][3].tensors()
