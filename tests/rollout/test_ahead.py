"""rollout.ahead: the window schedule and the prefetch buffer give Algorithm 1's batches."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest

from megatron_grpo.algorithms.seeds import sampling_seed
from megatron_grpo.config import ConfigError
from megatron_grpo.config.schema import RolloutConfig
from megatron_grpo.rollout.ahead import WindowBuffer, window_steps
from megatron_grpo.rollout.colocated import ColocatedRollout, engine_slice
from megatron_grpo.rollout.interface import sampling_args


@pytest.mark.parametrize(
    "step, ahead, v, steps, expected",
    [
        (1, 0, 4, 10, [1]),  # serial
        (1, 3, 4, 10, [1, 2, 3, 4]),  # the whole window after the initial sync
        (1, 9, 4, 10, [1, 2, 3, 4]),  # never past the next sync (after step 4)
        (5, 1, 4, 10, [5, 6]),
        (7, 3, 4, 10, [7, 8]),  # resumed mid-window: the rest of the window
        (9, 3, 4, 10, [9, 10]),  # never past the last step
        (3, 5, 1, 10, [3]),  # v=1: every step is its own window
        (4, 2, 4, 10, [4]),  # the sync step itself
    ],
)
def test_ahead_steps_end_at_the_next_sync_or_the_last_step(step, ahead, v, steps, expected):
    assert window_steps(step, ahead, v, steps) == expected


def test_window_steps_cover_each_window_once_and_stay_inside_it():
    for v in (1, 2, 3, 4, 8):
        for a in range(0, 9):
            step, seen = 1, []
            while step <= 13:
                got = window_steps(step, a, v, 13)
                # every generated step is served by the weights of step's window
                assert {(s - 1) // v for s in got} == {(step - 1) // v}
                seen += got
                step = got[-1] + 1
            assert seen == list(range(1, 14))


def test_window_steps_refuses_bad_arguments():
    with pytest.raises(ValueError, match="1 <= step <= total_steps"):
        window_steps(11, 1, 4, 10)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_config_refuses_bad_ahead(bad):
    with pytest.raises(ConfigError, match="rollout.ahead=.* must be an integer >= 0"):
        RolloutConfig(ahead=bad)


class Source:
    """A prompt stream like data.prompts.PromptSource: integers in order, a position."""

    def __init__(self, index: int = 0) -> None:
        self.index = index

    def next_batch(self, n: int) -> list:
        out = [SimpleNamespace(prompt_ids=[self.index + i]) for i in range(n)]
        self.index += n
        return out

    def state_dict(self) -> dict:
        return {"index": self.index}


def fake_generate(prompt_ids, seed):
    """One 'sample' per prompt that records its prompt and the seed it was drawn with."""
    return [(ids[0], seed + i) for i, ids in enumerate(prompt_ids)]


def serial(steps, p, rollout_seed, source):
    out = {}
    for s in steps:
        ids = [x.prompt_ids for x in source.next_batch(p)]
        out[s] = fake_generate(ids, sampling_seed(rollout_seed, s))
    return out


def recording_launch(calls):
    def launch(steps):
        calls.append([seed for _, seed in steps])
        return [lambda ids=ids, seed=seed: fake_generate(ids, seed) for ids, seed in steps]

    return launch


def test_ahead_gives_the_serial_batches_and_saves_the_consumed_position():
    p, v, steps = 3, 4, 10
    want = serial(range(1, steps + 1), p, 5, Source())
    calls: list = []
    src = Source()
    ahead = WindowBuffer(src, p, 3, v, steps, 5, recording_launch(calls))
    states = {}
    for s in range(1, steps + 1):
        _, samples = ahead.take(s)
        assert samples == want[s]
        states[s] = ahead.data_state()["index"]
    # one launch per window, each step with its own seed
    assert calls == [
        [sampling_seed(5, s) for s in w] for w in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10])
    ]
    # the position a checkpoint saves after step s is that of s consumed steps
    assert states == {s: s * p for s in range(1, steps + 1)}
    # resuming from the checkpoint of step 6 (mid-window) regenerates 7, 8 and goes on
    calls.clear()
    resumed = WindowBuffer(Source(states[6]), p, 3, v, steps, 5, recording_launch(calls))
    for s in range(7, steps + 1):
        assert resumed.take(s)[1] == want[s]
    assert calls == [
        [sampling_seed(5, 7), sampling_seed(5, 8)],
        [sampling_seed(5, 9), sampling_seed(5, 10)],
    ]


def test_ahead_refuses_out_of_order_steps():
    ahead = WindowBuffer(Source(), 2, 3, 4, 8, 0, recording_launch([]))
    ahead.take(1)
    with pytest.raises(RuntimeError, match="asked for step 3's batch but step 2's"):
        ahead.take(3)


def test_rewards_are_scored_as_batches_arrive():
    """The arrivals thread scores step 2's batch as soon as it arrives, while the trainer is
    still on step 1 (it has not asked for step 2), and take_scores hands each step its own."""
    import threading

    release = {s: threading.Event() for s in (1, 2)}
    scored: list = []
    step2_scored = threading.Event()

    def launch(steps):
        def wait_then(ids, seed, s):
            release[s].wait(10)
            return fake_generate(ids, seed)

        return [lambda ids=ids, seed=seed, s=s: wait_then(ids, seed, s)
                for s, (ids, seed) in zip((1, 2), steps)]  # fmt: skip

    def score(prompts, samples):
        scored.append(samples[0])
        if len(scored) == 2:
            step2_scored.set()
        return ("rewards of", samples[0])

    ahead = WindowBuffer(Source(), 2, 1, 2, 2, 0, launch, score)
    release[1].set()
    _, samples1 = ahead.take(1)
    assert ahead.take_scores() == ("rewards of", samples1[0])
    release[2].set()  # step 2's samples arrive while the trainer trains step 1
    assert step2_scored.wait(10), "step 2 was not scored before the trainer asked for it"
    _, samples2 = ahead.take(2)
    assert ahead.take_scores() == ("rewards of", samples2[0])
    assert scored == [samples1[0], samples2[0]]


def test_a_failed_generation_fails_its_take_and_the_rest_of_the_window():
    def launch(steps):
        def boom():
            raise RuntimeError("engine died")

        return [lambda: fake_generate(steps[0][0], steps[0][1]), boom, boom][: len(steps)]

    ahead = WindowBuffer(Source(), 2, 2, 3, 3, 0, launch, lambda p, s: 0)
    ahead.take(1)
    assert ahead.take_scores() == 0
    with pytest.raises(RuntimeError, match="engine died"):
        ahead.take(2)


class FakeEngine:
    """RolloutEngine.generate's contract: n samples per prompt, request i seeded seeds[i]."""

    def __init__(self):
        self.calls = []

    def generate(self, prompt_ids, n, seeds=None, seed=None, **_):
        self.calls.append(len(prompt_ids))
        if seeds is None:
            seeds = [seed + i * n for i in range(len(prompt_ids))]
        return [(ids[0], sd + c) for ids, sd in zip(prompt_ids, seeds) for c in range(n)]


def test_colocated_launch_seeds_each_request_as_its_steps_own_call():
    n, p = 2, 3
    engine = FakeEngine()
    ctx = SimpleNamespace(world_size=1, rank=0)
    launch = partial(ColocatedRollout(engine, ctx, 1).launch, n=n)
    steps = [([[10 * s + i] for i in range(p)], sampling_seed(0, s)) for s in (5, 6, 7)]
    got = [thunk() for thunk in launch(steps)]
    want = [FakeEngine().generate(ids, n, seed=seed) for ids, seed in steps]
    assert got == want
    assert engine.calls == [3 * p]  # one vLLM call for the three steps


def test_engine_slice_splits_prompts_in_contiguous_shares():
    assert [engine_slice(8, 3, e) for e in range(3)] == [slice(0, 2), slice(2, 5), slice(5, 8)]


def test_colocated_launch_reassembles_two_engines_shares_prompt_major(monkeypatch):
    import torch.distributed as dist

    n, p = 2, 5
    steps = [([[10 * s + i] for i in range(p)], sampling_seed(3, s)) for s in (1, 2)]
    # What the serial loop gets: engine e samples its slice of each step with seed + i*n.
    want = [
        [x for e in (0, 1) for x in FakeEngine().generate(ids[engine_slice(p, 2, e)], n, seed=sd)]
        for ids, sd in steps
    ]
    shares = {}

    class Captured(Exception):
        pass

    def launch_on(rank):
        rollout = ColocatedRollout(FakeEngine(), SimpleNamespace(world_size=2, rank=rank), 1)
        return partial(rollout.launch, n=n)

    def capture(everyone, mine):
        shares[len(shares)] = mine
        raise Captured

    monkeypatch.setattr(dist, "all_gather_object", capture)
    for rank in (0, 1):  # each rank's own share, as it would enter the gather
        with pytest.raises(Captured):
            launch_on(rank)(steps)

    def gather(everyone, mine):
        assert mine == shares[0]
        everyone[:] = [shares[0], shares[1]]

    monkeypatch.setattr(dist, "all_gather_object", gather)
    got = [t() for t in launch_on(0)(steps)]
    assert got == want


def test_sampling_args_for_training_validation_and_eval():
    """One builder of the sampling keywords: training samples with rollout.*, validation and
    eval's greedy with a temperature of their own over the whole distribution."""
    r = SimpleNamespace(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12)
    assert sampling_args(r, 4, 2) == dict(
        n=4, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12, stop_token_ids=[2]
    )
    assert sampling_args(r, 3, 2, temperature=1.0) == dict(
        n=3, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=12, stop_token_ids=[2]
    )
    assert sampling_args(r, 1, None, 0.0)["stop_token_ids"] is None
