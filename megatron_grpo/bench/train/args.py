"""``bench train``'s arguments and the setup they decide: the device and the model spec
(the command: ``bench/train/run.py``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from megatron_grpo.config.schema import ModelConfig
from megatron_grpo.models.shapes import preset_spec
from megatron_grpo.models.spec import ModelSpec
from megatron_grpo.policy.model_builder import resolve_dtype

SIDES = ("project", "project-padded", "hf", "hf-packed")
"""``bench train``'s sides (bench/train/sides.py)."""

SEARCH_START = 1024
"""First length of the largest-sequence search; it doubles from there."""


@dataclass
class BenchTrainArgs:
    preset: str = "tiny"
    """A preset of ``models/tiny.py`` (tiny, Qwen2.5-0.5B, Qwen2.5-1.5B, Qwen2.5-7B)."""
    rows: int = 32
    """Sequences in the batch."""
    prompt_len: int = 256
    """Longest prompt; prompts are uniform in [7/8 of it, it]."""
    min_len: int = 64
    """Shortest response (responses are uniform in [min_len, max_len])."""
    max_len: int = 1024
    """Longest response."""
    micro_batch_size: int = 4
    micro_batch_tokens: int | None = None
    """The project side's token budget per packed micro-batch (``grpo.batch.micro_batch_tokens``);
    None: ``micro_batch_size * (prompt_len + max_len)``, the trainer's ``micro_batch_tokens=0``
    (and its ``auto`` off the GPU; on a GPU ``auto`` is sized by memory, ``dry_run.budget``);
    0: padded rows of ``micro_batch_size`` like the HF side
    (``grpo.batch.pack_sequences=false``)."""
    recompute: Literal["none", "full"] = "none"
    """Activation recomputation on both sides: ``full`` is the project's
    ``model.recompute=full`` and HF's ``gradient_checkpointing_enable()``."""
    steps: int = 5
    """Timed repeats per phase (the median is reported)."""
    warmup: int = 2
    """Untimed repeats before them."""
    device: str = "auto"
    """``auto`` (cuda when available), ``cuda`` or ``cpu``."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """``auto`` (bf16 on GPU, fp32 on CPU), ``bfloat16`` or ``float32``: both sides."""
    peak_tflops: float | None = None
    """Device peak for MFU; default from ``PEAK_BF16_TFLOPS`` (None on CPU: MFU n/a)."""
    search: str = "auto"
    """Largest trainable sequence search: ``auto`` (on GPU only), ``on`` or ``off``."""
    search_cap: int = 32768
    """Longest sequence the search tries."""
    seed: int = 0
    lr: float = 1e-6
    sides: str = "project,hf,hf-packed"
    """The sides measured, in order (the project first: the others load its weights)."""
    liger: Literal["auto", "on", "off"] = "auto"
    """Liger-Kernel on the project side (``model.kernels.liger``) and the ``hf-packed`` side:
    ``auto`` (where installed, on CUDA), ``on``, ``off``."""

    def __post_init__(self) -> None:
        for k in ("rows", "prompt_len", "min_len", "max_len", "micro_batch_size", "steps"):
            if getattr(self, k) < 1:
                raise ValueError(f"--{k.replace('_', '-')}={getattr(self, k)} must be >= 1.")
        if self.warmup < 0:
            raise ValueError(f"--warmup={self.warmup} must be >= 0.")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 0:
            raise ValueError(
                f"--micro-batch-tokens={self.micro_batch_tokens} must be >= 0 (0: padded rows)."
            )
        if self.min_len > self.max_len:
            raise ValueError(
                f"--min-len={self.min_len} > --max-len={self.max_len}: responses are drawn "
                "from [min-len, max-len]; lower --min-len or raise --max-len."
            )
        choices = {
            "device": ("auto", "cuda", "cpu"),
            "dtype": ("auto", "bfloat16", "float32"),
            "search": ("auto", "on", "off"),
            "recompute": ("none", "full"),
            "liger": ("auto", "on", "off"),
        }
        for k, allowed in choices.items():
            if getattr(self, k) not in allowed:
                raise ValueError(f"--{k}={getattr(self, k)!r}: choose one of {list(allowed)}.")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"--peak-tflops={self.peak_tflops} must be > 0.")
        if self.search_cap < SEARCH_START:
            raise ValueError(f"--search-cap={self.search_cap} must be >= {SEARCH_START}.")
        sides = self.sides.split(",")
        if sides[0] != "project" or not set(sides) <= set(SIDES) or len(set(sides)) != len(sides):
            raise ValueError(
                f"--sides={self.sides!r}: a comma list of {list(SIDES)} starting with project "
                "(the other sides load the project's initial weights)."
            )
        preset_spec(self.preset)  # ConfigError naming the presets
        resolve_dtype(ModelConfig(dtype=self.dtype), resolve_device(self.device))


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available. ``cpu`` is refused on a CUDA machine: the project's
    CPU platform layer (platform/cpu.py) applies only where no CUDA device is present."""
    cuda = torch.cuda.is_available()
    if name == "cuda" and not cuda:
        raise ValueError("--device cuda, but torch sees no CUDA device: use --device cpu.")
    if name == "cpu" and cuda:
        raise ValueError(
            "--device cpu on a machine with CUDA: the project's CPU layer applies only without "
            "a CUDA device; run with CUDA_VISIBLE_DEVICES= to bench on the CPU."
        )
    return torch.device("cuda" if cuda else "cpu")


def bench_spec(preset: str, longest: int) -> ModelSpec:
    """The preset's spec, with ``max_position_embeddings`` at least ``longest`` (RoPE has no
    learned positions; the presets' config value is only a default)."""
    spec = preset_spec(preset)
    if spec.max_position_embeddings < longest:
        spec = dataclasses.replace(spec, max_position_embeddings=longest)
    return spec
