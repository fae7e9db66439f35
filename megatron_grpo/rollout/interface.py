"""One rollout interface for both placements, chosen once when the run is built.

The trainer sees ``Rollout`` and a weight sender, never the placement:

- ``colocated`` (``rollout.colocated.ColocatedRollout``): each trainer rank hosts a TP rank
  of an in-process vLLM engine; the sender writes into it (``bridge.weight_sync.colocated_sender``);
- ``disaggregated`` (``rollout.client.RolloutClient``): the last ranks of the world serve
  standalone engines; the sender runs the same plan over a transfer group
  (``bridge.weight_sync.remote_sender``) and the control messages start and end each update.

Both split a step's prompts over the engines the same way and return every sample on every
trainer rank, prompt-major. ``launch`` starts several steps' generation at once (the sync
window's, ``rollout.ahead``); ``generate`` is one step's, waited for.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from megatron_grpo.bridge.weight_sync import WeightSender
from megatron_grpo.config import Config
from megatron_grpo.config.schema import RolloutConfig
from megatron_grpo.distributed import ParallelContext
from megatron_grpo.policy import Policy
from megatron_grpo.rollout.agent import StepPrompts
from megatron_grpo.rollout.client import connect_rollout
from megatron_grpo.rollout.colocated import build_colocated
from megatron_grpo.rollout.server import DisaggregatedWorld


class Rollout(Protocol):
    def launch(self, steps: list[StepPrompts], **sampling: Any) -> list[Callable[[], list | None]]:
        """Start generating ``[(prompt_ids, seed)]`` per step (``(prompt_ids, seed, rows)``
        with the data rows of multi-turn episodes, ``env.name``); one thunk per step returns
        that step's samples, blocking until they are there, on the ranks where they arrive
        (None elsewhere). Thunks run no collective: a background thread may call them."""

    def share(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` evaluated where ``launch``'s samples arrive, its result (or its error) on
        every trainer rank (collective)."""

    def generate(
        self, prompt_ids: list, seed: int, rows: list | None = None, **sampling: Any
    ) -> list:
        """One batch's samples, prompt-major, on every trainer rank (episodes of ``rows``
        with ``env.name``)."""

    def shutdown(self) -> None:
        """Stop the engines (idempotent)."""


def sampling_args(
    r: RolloutConfig, n: int, eos_token_id: int | None, temperature: float | None = None
) -> dict[str, Any]:
    """The sampling keywords of ``Rollout.launch`` / ``generate`` (``RolloutEngine.generate``'s),
    built in this one place for training, validation and eval: ``n`` samples per prompt of
    at most ``rollout.max_new_tokens`` tokens, stopping at ``eos_token_id`` (None: no stop
    token). ``temperature`` None samples as training does (``rollout.temperature``, ``top_p``,
    ``top_k``); a number samples the whole distribution at that temperature (top_p 1, top_k
    off): validation's ``eval.temperature``, eval's greedy 0."""
    if temperature is None:
        temperature, top_p, top_k = r.temperature, r.top_p, r.top_k
    else:
        top_p, top_k = 1.0, -1
    stop = [eos_token_id] if eos_token_id is not None else None
    return dict(n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                max_new_tokens=r.max_new_tokens, stop_token_ids=stop)  # fmt: skip


class RolloutFailure(RuntimeError):
    """The vLLM engine failed during a rollout; the message names the last checkpoint."""

    @classmethod
    def during(cls, step: int, error: BaseException, latest: Any, run_dir: Any) -> RolloutFailure:
        """Step ``step``'s rollout failed with ``error``; ``latest``: the last checkpoint."""
        where = f"the last checkpoint {latest} is intact" if latest else "no checkpoint yet"
        return cls(
            f"vLLM engine failed during the rollout of step {step} ({type(error).__name__}: "
            f"{error}); {where}. Fix the cause, then continue with `megatron-grpo train "
            f"--resume --run-dir {run_dir}`."
        )


RolloutFactory = Callable[
    [Config, DisaggregatedWorld | None, ParallelContext, Path, Policy], tuple[Rollout, WeightSender]
]
"""What builds a run's engines and weight sender: ``build_rollout``, or a test's stand-in
(tests/gpu/hf_engine.py)."""


def build_rollout(cfg: Config, world: DisaggregatedWorld | None, ctx: ParallelContext,
                  hf_dir: Path, policy: Policy) -> tuple[Rollout, WeightSender]:  # fmt: skip
    """The run's engines and the weight sender that feeds them ``policy``'s shards:
    colocated when ``world`` is None, else this trainer rank's handle on the disaggregated
    world (``rollout.server.DisaggregatedWorld``)."""
    if world is None:
        return build_colocated(hf_dir, policy.spec, ctx, cfg, policy)
    return connect_rollout(cfg, world, ctx, hf_dir, policy)
