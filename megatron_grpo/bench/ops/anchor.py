"""``bench ops --sides``: the Hugging Face anchors of ``bench train`` (``hf``: padded rows, SDPA;
``hf-packed``: padding removed, the project's varlen attention) counted like the project's
policy, on its batch and its weights, and the project/anchor ratio of each figure
(docs/benchmarks.md §7)."""

from __future__ import annotations

import math

import torch

from megatron_grpo.algorithms.step_batch import LossBatch
from megatron_grpo.bench.train.args import BenchTrainArgs
from megatron_grpo.bench.train.batch import grpo_loss_fn
from megatron_grpo.bench.train.sides import HFSide
from megatron_grpo.models.spec import ModelSpec

SIDES = ("project", "hf", "hf-packed")

RATIO_FIGURES = {
    "ops": ("ops", "total"),
    "ops_per_layer_per_micro_batch": ("ops", "per_layer_per_micro_batch"),
    "python_calls_per_layer_per_micro_batch": ("python", "per_layer_per_micro_batch"),
    "host_syncs": ("syncs", "total"),
    "flops_per_token": ("flops", "per_token"),
    "saved_bytes_per_token": ("saved_bytes", "per_token"),
    "saved_bytes_per_token_per_layer": ("saved_bytes", "per_token_per_layer"),
}
"""The figures compared, by the key of their project/anchor ratio: (group, figure) of a
phase's result (the saved bytes only in ``train``)."""


def padded_rows_per_micro_batch(rows: int, micro_batches: int) -> int:
    """The ``hf`` side's rows per micro-batch: as many micro-batches as the project's packs."""
    return math.ceil(rows / micro_batches)


class AnchorRun:
    """A ``bench train`` HF side (``name``: hf or hf-packed) of ``spec`` holding ``state``
    (the project's weights under HF names) and its two calls on ``batch``."""

    def __init__(
        self,
        name: str,
        spec: ModelSpec,
        state: dict[str, torch.Tensor],
        device: torch.device,
        batch: LossBatch,
        budget: int,
        rows_per_micro_batch: int,
        dtype: str,
        recompute: str,
        fused_adam: bool | None,
    ) -> None:
        args = BenchTrainArgs(
            preset="tiny", rows=batch.input_ids.shape[0], micro_batch_size=rows_per_micro_batch,
            recompute=recompute, device=device.type, dtype=dtype, search="off",  # type: ignore[arg-type]
        )  # fmt: skip
        packed = budget if name == "hf-packed" else None
        torch_dtype = getattr(torch, dtype)
        self.side = HFSide(spec, state, device, torch_dtype, args, packed, fused_adam=fused_adam)
        self.batch, self.loss_fn = batch, grpo_loss_fn()

    def params(self) -> list[torch.Tensor]:
        return list(self.side.model.parameters())

    def logprobs(self):
        return self.side.logprobs(self.batch)

    def train_step(self):
        return self.side.train_step(self.batch, self.loss_fn)

    def close(self) -> None:
        self.side.close()


def ratios(project: dict, anchor: dict) -> dict[str, dict[str, float | None]]:
    """project/anchor of each figure of ``RATIO_FIGURES``, by phase (None where the anchor's
    figure is 0)."""
    out: dict[str, dict[str, float | None]] = {}
    for phase, p in project.items():
        a = anchor[phase]
        out[phase] = {}
        for key, (group, fig) in RATIO_FIGURES.items():
            if group in p:
                num, den = p[group][fig], a[group][fig]
                out[phase][key] = num / den if den else None
    return out
