"""``rollout.placement=disaggregated`` end to end on CPU: torchrun world of 2 (trainer rank 0,
rollout rank 1 driving a standalone vLLM engine of tp 1 whose worker is its own process);
the weights cross processes through the bridge's plan and transport on both sides. Here:
``rollout.ahead`` against the serial schedule. The syncs, validation and served weights of a
4-step run are checked on the restarted job of tests/e2e/test_faults.py (one launch for both).

Runs ``python -m torch.distributed.run ... megatron_grpo.cli.main train`` in a subprocess
with a timeout; the process group it starts (torchrun, its ranks, vLLM's processes) is
killed by this helper if it is still alive.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers.runs import FAST, torchrun_train

pytestmark = pytest.mark.slow


# ------------------------------------------------------------------------------ rollout.ahead
@pytest.mark.timeout(1200)
def test_ahead_streams_the_window_and_logs_what_the_serial_schedule_logs(tmp_path):
    """rollout.ahead=3 (v=4): the engines generate steps 1..4 back to back after the initial
    sync; the metrics equal the serial run's (same prompts, seeds and served weights), also
    after a resume from step 2, when steps 3 and 4 had been generated ahead."""
    from tests.helpers.runs import assert_same_rows

    def run(run_dir, *args, flags=()):
        rc, out, left = torchrun_train(
            run_dir, *flags, "--steps", "5", "--sync-interval", "4", "rollout.placement=disaggregated",
            "rollout.num_engines=1", "checkpoint.interval=2", "checkpoint.keep_last=3", *FAST,
            *args, timeout=400,
        )  # fmt: skip
        assert rc == 0, out[-4000:]
        assert not left, f"processes of the run still alive after it ended: {left}"
        return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]

    def same(a, b):
        assert [x["step"] for x in b] == [1, 2, 3, 4, 5]
        assert [x["policy_version"] for x in b] == [0, 0, 0, 0, 4]
        assert [x["lag"] for x in b] == [0, 1, 2, 3, 0]
        assert_same_rows(a, b)

    serial = run(tmp_path / "serial")
    ahead_dir = tmp_path / "ahead"
    same(serial, run(ahead_dir, "rollout.ahead=3"))
    # Resume mid-window: the checkpoint of step 2 must hold the data position of 2 consumed
    # steps (not of the 4 generated ones), so steps 3 and 4 are drawn and generated again.
    ckpts = ahead_dir / "checkpoints"
    for later in ("step_000004", "step_000005", "latest"):
        target = ckpts / later
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)
    (ahead_dir / "summary.json").unlink()  # a run stopped after step 2 wrote none
    same(serial, run(ahead_dir, "rollout.ahead=3", flags=["--resume"]))
