"""Shared pieces of the conversion tools (``checkpoints_tools``): dtypes, metadata, atomic
output, the runtime. Here, not in the tools, because ``megatron-grpo eval`` reads a converted
checkpoint too (``evaluation/source.py``).

A converted Megatron checkpoint directory (``CKPT_DIR``) holds:

- the megatron-core ``dist_checkpointing`` files (torch_dist backend) of
  ``{"model": GPTModel.sharded_state_dict()}`` -- the same key as the ``model/`` directory
  of a training checkpoint, so the trainer loads it at any TP/PP (dist_checkpointing stores
  global tensors; the vocabulary rows carry ``allow_shape_mismatch`` so Megatron's
  TP-dependent vocabulary padding may differ between save and load);
- ``megatron_grpo_checkpoint.json``: :class:`CheckpointInfo`;
- ``hf/``: the source's config.json, generation_config.json and tokenizer files, so that
  ``mcore-to-hf`` can write a complete HF directory without ``--hf-config``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_grpo.checkpoint import damage
from megatron_grpo.config import ConfigError, load_config
from megatron_grpo.config.schema import ModelConfig, ParallelConfig
from megatron_grpo.distributed.setup import ParallelContext, distributed_context
from megatron_grpo.models.spec import ModelSpec
from megatron_grpo.models.tiny import PRESETS
from megatron_grpo.policy.model_builder import build_model

INFO_FILE = "megatron_grpo_checkpoint.json"
HF_SUBDIR = "hf"
STATE_KEY = "model"
FORMAT_VERSION = 1

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# safetensors header dtype codes (safetensors' ``get_dtype``)
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}

# Files of an HF model directory other than weights, copied when present.
HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


class ConvertError(ValueError):
    """Bad input to a conversion: the message names the file or tensor and the fix."""


@dataclass
class CheckpointInfo:
    """``megatron_grpo_checkpoint.json``: what a converted checkpoint holds."""

    spec: dict
    """``ModelSpec.to_dict()`` of the model."""
    dtype: str
    """Parameter dtype stored in the checkpoint."""
    source: str
    """Where the weights came from (an HF directory, or a training run)."""
    parallel: dict = field(default_factory=lambda: {"tp": 1, "pp": 1, "vpp": None})
    """The layout the checkpoint was written with (it loads at any other)."""
    step: int | None = None
    """Training step, when the weights come from training."""
    state_key: str = STATE_KEY
    format_version: int = FORMAT_VERSION

    def model_spec(self) -> ModelSpec:
        return ModelSpec(**self.spec)

    def write(self, ckpt_dir: Path) -> None:
        (ckpt_dir / INFO_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, ckpt_dir: Path) -> CheckpointInfo | None:
        path = ckpt_dir / INFO_FILE
        if not path.is_file():
            return None
        raw = json.loads(path.read_text())
        return cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})


def resolve_dtype(source: str, requested: str | None) -> str:
    """The output dtype: ``requested`` if given (an explicit choice, lossy or not), else the
    source's own dtype -- never a silent downcast."""
    if requested is None:
        return source
    if requested not in DTYPES:
        raise ConvertError(f"--dtype {requested!r}: choose one of {sorted(DTYPES)}")
    return requested


def widest(dtypes: set[str], where: str) -> str:
    """The dtype that represents every tensor exactly (mixed bf16/fp16 -> float32)."""
    names = set()
    for d in dtypes:
        if d not in SAFETENSORS_DTYPES and d not in DTYPES:
            raise ConvertError(
                f"{where}: tensors of dtype {d} are not supported (float32/bfloat16/float16)"
            )
        names.add(SAFETENSORS_DTYPES.get(d, d))
    if len(names) == 1:
        return names.pop()
    return "float32"


@contextlib.contextmanager
def atomic_output_dir(out: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``out``; rename it to ``out`` on success, delete it on
    any failure, so no partial output is ever left under ``out``."""
    out = Path(out)
    if out.exists():
        raise ConvertError(
            f"output directory {out} already exists: remove it or choose another --out"
        )
    if not out.parent.is_dir():
        raise ConvertError(f"parent directory {out.parent} of --out does not exist")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_side_files(src: Path, dst: Path, dtype: str | None = None) -> list[str]:
    """Copy config/tokenizer files that exist in ``src``; set config.json's ``torch_dtype``
    (or ``dtype``, transformers 5's name) to ``dtype`` when given. Returns copied names."""
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in HF_SIDE_FILES:
        f = src / name
        if not f.is_file():
            continue
        if name == "config.json" and dtype is not None:
            cfg = json.loads(f.read_text())
            # transformers 5 writes ``dtype``, older versions ``torch_dtype``
            keys = [k for k in ("dtype", "torch_dtype") if k in cfg] or ["torch_dtype"]
            for k in keys:
                cfg[k] = dtype
            (dst / name).write_text(json.dumps(cfg, indent=2) + "\n")
        else:
            shutil.copyfile(f, dst / name)
        copied.append(name)
    return copied


@contextlib.contextmanager
def one_process_model(
    spec: ModelSpec, dtype: str
) -> Iterator[tuple[ParallelContext, list[torch.nn.Module]]]:
    """(ctx, model chunks at ``dtype``) in a one-process megatron-core runtime (gloo,
    TP=PP=1) from megatron_grpo.distributed, torn down on exit. Conversion is a single
    process: the checkpoint it writes reshards on load, so the writer's layout does not
    matter. ``build_model`` makes CPU models in float32 only (its training rule), so other
    dtypes are cast after construction."""
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ConvertError(
            f"convert runs as one process, but WORLD_SIZE={os.environ['WORLD_SIZE']}: "
            "run it without torchrun."
        )
    with distributed_context(ParallelConfig(tp=1, pp=1, backend="gloo"), spec) as ctx:
        chunks = build_model(spec, ctx, ModelConfig(dtype="float32", transformer_impl="local"))
        if dtype != "float32":
            chunks = [c.to(DTYPES[dtype]) for c in chunks]
        yield ctx, chunks


def sharded_state(chunks: list[torch.nn.Module]) -> dict:
    if len(chunks) != 1:
        raise ConvertError("conversion builds one model chunk (vpp disabled)")
    chunk: Any = chunks[0]  # a MegatronModule (megatron is not type-checked here)
    return {STATE_KEY: chunk.sharded_state_dict()}


def run_hf_dir(run_dir: Path) -> Path:
    """The HF directory (config.json + tokenizer) a training run trained from: its
    ``config.yaml``'s ``model.hf_path``, a preset's under ``RUN_DIR/hf_model/``. Both
    ``eval`` and ``convert mcore-to-hf`` find a run's model this way."""
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        raise ConfigError(
            f"{run_dir} has no config.yaml to find the model's HF config: pass --hf-config "
            "with the HF directory the run trained from."
        )
    hf_path = load_config(cfg_file).model.hf_path
    hf = run_dir / "hf_model" / hf_path if hf_path in PRESETS else Path(hf_path)
    if not (hf / "config.json").is_file():
        raise ConfigError(
            f"{cfg_file} names model.hf_path={hf_path!r}, but {hf} has no config.json: pass "
            "--hf-config with the HF directory the run trained from."
        )
    return hf


def find_dist_checkpoint(ckpt: Path) -> tuple[Path, int | None]:
    """The dist_checkpointing directory inside ``ckpt`` and the training step if known.

    Accepts a converted CKPT_DIR, a training checkpoint ``step_XXXXXX/`` (the trained
    weights in its ``policy/`` part, as ``megatron-grpo train`` writes them, or ``model/``;
    the step in ``state.json``), or a run's ``checkpoints/`` (uses ``latest``).
    """
    if not ckpt.is_dir():
        raise ConvertError(f"--ckpt {ckpt} is not a directory")
    if (ckpt / "latest").is_file():
        ckpt = ckpt / (ckpt / "latest").read_text().strip()
    if (ckpt / "metadata.json").is_file():
        check_shards(ckpt)
        return ckpt, None
    for part in ("policy", "model"):
        if (ckpt / part / "metadata.json").is_file():
            step = None
            state = ckpt / "state.json"
            if state.is_file():
                problem = damage(ckpt)  # sizes and checksums recorded at save
                if problem:
                    raise ConvertError(f"{ckpt} is damaged: {problem}; use another checkpoint.")
                step = json.loads(state.read_text()).get("step")
            check_shards(ckpt / part)
            return ckpt / part, step
    raise ConvertError(
        f"{ckpt} holds no megatron dist checkpoint (no metadata.json here, in policy/ or in "
        "model/): "
        "point --ckpt at a converted checkpoint or a training checkpoint step directory."
    )


def check_shards(dist_dir: Path) -> None:
    """Raise ConvertError naming the first missing or truncated shard of a torch_dist
    checkpoint: its ``.metadata`` says where each tensor's bytes lie (file, offset, length),
    so every ``.distcp`` file must reach the end of its last item."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(dist_dir)).read_metadata().storage_data
    except Exception as e:  # a missing, truncated or foreign .metadata file
        raise ConvertError(
            f"{dist_dir}/.metadata is missing or unreadable ({type(e).__name__}): the checkpoint "
            "is damaged; use another one."
        ) from e
    need: dict[str, int] = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        path = dist_dir / rel
        if not path.is_file():
            raise ConvertError(f"{path} is missing: the checkpoint is damaged; use another one.")
        if path.stat().st_size < size:
            raise ConvertError(
                f"{path} is truncated ({path.stat().st_size} of at least {size} bytes): the "
                "checkpoint is damaged; use another one."
            )
