"""The token budget of a packed micro-batch (``grpo.batch.micro_batch_tokens``), and what bounds it.

``auto`` on a GPU is sized by the memory model of ``dry_run.memory``: the largest multiple of
``BUDGET_MULTIPLE`` tokens whose activations and scoring (the fused scoring holds no logits)
fit what ``MEMORY_FRACTION`` of the GPU's memory leaves in the train phase after the weights,
gradients, optimizer state, copies and runtime (and vLLM's reservation when it does not
sleep); at least one whole sequence, which never splits, and at most one step's sequences
per rank, in at least ``PIPELINE_MICRO_BATCHES * pp`` micro-batches with pipeline
parallelism. docs/launch.md ("micro-batch token budget") has the reasoning. Without a GPU (the
trainer on CPU) ``auto`` is ``grpo.batch.micro_batch_size`` full-length sequences, the budget of
before, so CPU runs and their golden numbers are unchanged. ``plan`` and the trainer print
``TokenBudget.line``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_grpo.config.schema import Config
from megatron_grpo.dry_run.memory import GIB, activation_bytes, estimate_memory
from megatron_grpo.models.spec import ModelSpec
from megatron_grpo.policy.micro_batches import micro_batch_token_budget

BUDGET_MULTIPLE = 256
"""``auto`` budgets bounded by memory are a multiple of this many tokens."""
MEMORY_FRACTION = 0.9
"""``auto`` fills this much of the GPU, not all of it: the memory model is an estimate (on one
H100 it was 3.5% low for a 16,384-token sequence at 0.5B, 38.3 vs 39.7 GiB measured, and 13%
high at 1.5B with recompute: docs/benchmarks.md §4) and counts no allocator fragmentation,
which micro-batches of varying length cause."""
PIPELINE_MICRO_BATCHES = 4
"""With pp > 1, ``auto`` keeps at least this many micro-batches per pipeline stage in a
train step: 1F1B's bubble is (pp - 1) / m of m micro-batches (Narayanan et al., arXiv
2104.04473, §2.2.1), so one huge micro-batch would leave every stage but one idle."""


@dataclass(frozen=True)
class TokenBudget:
    """A packed micro-batch's token budget (None: padded rows), what bounds it and why."""

    tokens: int | None
    bound: str
    """``padded``, ``config`` (an explicit value), ``micro_batch_size`` (0, or ``auto`` on
    CPU), or for ``auto`` on a GPU: ``memory``, ``batch``, ``pipeline`` or ``sequence`` (one
    sequence exceeds ``MEMORY_FRACTION``; ``plan`` refuses it if it exceeds the GPU)."""
    why: str

    def line(self) -> str:
        """``13,568 tokens each (auto, bounded by memory: ...)``: plan's and the trainer's."""
        if self.tokens is None:
            return self.why
        return f"{self.tokens:,} tokens each ({self.why})"


def _train_state_bytes(
    spec: ModelSpec, cfg: Config, dp: int, colocated: bool, capacity: int, recompute: bool, seq: int
) -> tuple[int, int]:
    """(bytes of the train phase without activations, activations of one sequence)."""
    report = estimate_memory(spec, cfg, dp=dp, num_engines=1, colocated=colocated,
                             capacity_bytes=capacity, recompute=recompute, budget=seq)  # fmt: skip
    role = report.per_role["train+rollout" if colocated else "train"]
    act = role.components["activations"]
    return role.phases.get("train", role.total) - act, act


def resolve_token_budget(
    spec: ModelSpec | None,
    cfg: Config,
    *,
    dp: int,
    colocated: bool,
    capacity_bytes: int | None,
    recompute: bool = False,
) -> TokenBudget:
    """The budget the trainer and ``plan`` use (module docstring). ``capacity_bytes``: one
    GPU's memory (None: no GPU; then ``spec`` is not read); ``recompute`` as
    ``estimate_memory``'s."""
    g = cfg.grpo
    seq = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    rows = f"grpo.batch.micro_batch_size({g.batch.micro_batch_size}) x {seq:,} tokens"
    if not g.batch.pack_sequences:
        return TokenBudget(None, "padded", f"{rows}, padded (grpo.batch.pack_sequences=false)")
    if g.batch.micro_batch_tokens != "auto":
        if g.batch.micro_batch_tokens:
            return TokenBudget(
                g.batch.micro_batch_tokens, "config", "grpo.batch.micro_batch_tokens"
            )
        return TokenBudget(
            micro_batch_token_budget(cfg),
            "micro_batch_size",
            f"grpo.batch.micro_batch_tokens=0: {rows}",
        )
    if capacity_bytes is None:
        return TokenBudget(
            micro_batch_token_budget(cfg), "micro_batch_size", f"auto without a GPU: {rows}"
        )
    if spec is None:
        raise ValueError("resolve_token_budget: a GPU's budget (capacity_bytes) needs the spec.")
    recompute = recompute or cfg.model.recompute == "full"
    state, one = _train_state_bytes(spec, cfg, dp, colocated, capacity_bytes, recompute, seq)
    room = int(MEMORY_FRACTION * capacity_bytes) - state
    where = (
        f"of the {room / GIB:.1f} GiB left in the train phase by {MEMORY_FRACTION:.0%} of "
        f"the {capacity_bytes / GIB:g} GiB GPU"
    )
    if one > room:
        held = (f"the train phase's {state / GIB:.1f} GiB of state already exceed"
                if room <= 0 else f"its {one / GIB:.1f} GiB of activations and scoring exceed "
                f"the {room / GIB:.1f} GiB left in the train phase by")  # fmt: skip
        return TokenBudget(seq, "sequence", f"auto: one sequence, though {held} "
                           f"{MEMORY_FRACTION:.0%} of the {capacity_bytes / GIB:g} GiB GPU")  # fmt: skip
    top, bound = _upper(cfg, dp, seq)

    def act(n: int) -> int:
        return activation_bytes(spec, cfg, dp, recompute, n)

    if act(top) > room:  # the largest multiple that fits (act grows with n below ``top``)
        lo, hi = 0, -(-top // BUDGET_MULTIPLE)  # multiple lo fits (or is below seq), hi not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if act(mid * BUDGET_MULTIPLE) <= room else (lo, mid)
        top, bound = max(seq, lo * BUDGET_MULTIPLE), "memory"
    used = f"{act(top) / GIB:.1f} GiB of activations and scoring, {where}"
    what = {
        "memory": "the most that fits",
        "batch": f"a step's {math.ceil(g.batch.prompts_per_step * g.group_size / dp)} sequences per rank",
        "pipeline": f"{PIPELINE_MICRO_BATCHES * cfg.parallel.pp} micro-batches per step at pp={cfg.parallel.pp}",
    }[bound]
    return TokenBudget(top, bound, f"auto, bounded by {bound}: {what}; {used}")


def _upper(cfg: Config, dp: int, seq: int) -> tuple[int, str]:
    """The largest useful budget: one step's sequences per rank (the log-prob pass takes the
    whole step), or with pp > 1 the train step's mini-batch over PIPELINE_MICRO_BATCHES * pp
    micro-batches (a multiple of BUDGET_MULTIPLE, at least one sequence)."""
    g, pp = cfg.grpo, cfg.parallel.pp
    step = g.batch.prompts_per_step * g.group_size
    top = math.ceil(step / dp) * seq
    if pp > 1:
        mini = math.ceil((g.batch.mini_batch_size or step) / dp) * seq
        piped = mini // (PIPELINE_MICRO_BATCHES * pp) // BUDGET_MULTIPLE * BUDGET_MULTIPLE
        if max(piped, seq) < top:
            return max(piped, seq), "pipeline"
    return top, "batch"
