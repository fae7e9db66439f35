"""megatron-core dist checkpoint -> HF safetensors directory.

Reads a converted checkpoint or a training checkpoint (``step_XXXXXX/`` or a run's
``checkpoints/``), loads it into a one-process model (TP=PP=1) and writes the HF tensors
layer by layer (layouts.io.iter_hf_tensors) into size-bounded safetensors shards + index.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from megatron_grpo.checkpoint.conversion import (
    DTYPES,
    HF_SUBDIR,
    CheckpointInfo,
    ConvertError,
    atomic_output_dir,
    copy_side_files,
    find_dist_checkpoint,
    one_process_model,
    resolve_dtype,
    run_hf_dir,
    sharded_state,
)
from megatron_grpo.layouts.io import iter_hf_tensors
from megatron_grpo.metrics.console import console_err
from megatron_grpo.models.spec import ModelSpec, load_spec

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3


def write_safetensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: Path,
    dtype: torch.dtype,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
    """Write (name, tensor) pairs as HF safetensors shards; at most ``max_shard_bytes`` per
    file (a larger single tensor gets a file of its own). One file is ``model.safetensors``;
    several are ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``.
    """
    from safetensors.torch import save_file

    parts: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}
    size = 0
    total = 0

    def flush() -> None:
        nonlocal current, size
        if current:
            save_file(
                current, str(out_dir / f"part-{len(parts):05d}.tmp"), metadata={"format": "pt"}
            )
            parts.append(list(current))
            current, size = {}, 0

    for name, t in tensors:
        t = t.to(dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            flush()
        current[name] = t
        size += nbytes
        total += nbytes
    flush()
    if len(parts) == 1:
        (out_dir / "part-00000.tmp").rename(out_dir / "model.safetensors")
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, keys in enumerate(parts):
        fname = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        (out_dir / f"part-{i:05d}.tmp").rename(out_dir / fname)
        names.append(fname)
        weight_map.update({k: fname for k in keys})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def _check_against_checkpoint(state: dict, dist_dir: Path, spec: ModelSpec) -> None:
    """Name the first tensor the checkpoint lacks or holds with another shape."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    meta = dist_checkpointing.load_tensors_metadata(str(dist_dir))
    for sh in state.values():
        if not isinstance(sh, ShardedTensor):
            continue
        if sh.key not in meta:
            raise ConvertError(
                f"{dist_dir}: tensor {sh.key!r} is missing; the checkpoint is not a "
                f"{spec.family} model with {spec.num_layers} layers (wrong --hf-config?)"
            )
        got = tuple(meta[sh.key].global_shape)
        want = tuple(sh.global_shape)
        if sh.allow_shape_mismatch:  # vocabulary rows: padding may differ, the real rows not
            if got[1:] != want[1:] or got[0] < spec.vocab_size:
                raise ConvertError(
                    f"{dist_dir}: {sh.key} has shape {got}, expected ({spec.vocab_size}+, {want[1]})"
                )
        elif got != want:
            raise ConvertError(f"{dist_dir}: {sh.key} has shape {got}, the config implies {want}")


def _checkpoint_dtype(dist_dir: Path) -> str:
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(dist_dir))
    found = {str(sh.dtype).split(".")[-1] for sh in meta.values() if hasattr(sh, "dtype")}
    found &= set(DTYPES)
    if len(found) != 1:
        raise ConvertError(f"{dist_dir}: model tensors have dtypes {sorted(found)}; pass --dtype")
    return found.pop()


def mcore_to_hf(
    ckpt: str | Path,
    out: str | Path,
    hf_config: str | Path | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> dict:
    """Convert the checkpoint ``ckpt`` into an HF directory ``out`` (which must not exist).

    ``hf_config``: an HF directory whose config.json / tokenizer files describe the model;
    optional for checkpoints written by ``hf-to-mcore`` (they carry them in ``hf/``) and for
    a training run's checkpoints (the model its ``config.yaml`` names, as ``eval`` finds it).
    Returns a summary dict.
    """
    from megatron.core import dist_checkpointing
    from tqdm import tqdm

    ckpt = Path(ckpt)
    dist_dir, step = find_dist_checkpoint(ckpt)
    info = CheckpointInfo.read(dist_dir)
    if hf_config is not None:
        side = Path(hf_config)
        spec = load_spec(side)
        if info is not None and info.model_spec() != spec:
            raise ConvertError(
                f"--hf-config {side} describes {spec}, but {dist_dir} was written for "
                f"{info.model_spec()}"
            )
    elif info is not None and (dist_dir / HF_SUBDIR / "config.json").is_file():
        side, spec = dist_dir / HF_SUBDIR, info.model_spec()
    elif step is not None:  # a training checkpoint: RUN/checkpoints/step_N/policy
        side = run_hf_dir(dist_dir.parent.parent.parent)
        spec = load_spec(side)
    else:
        raise ConvertError(
            f"{ckpt} carries no HF config (no {HF_SUBDIR}/config.json): pass --hf-config with "
            "the HF directory the model was trained from."
        )
    ckpt_dtype = info.dtype if info is not None else _checkpoint_dtype(dist_dir)
    out_dtype = resolve_dtype(ckpt_dtype, dtype)
    with atomic_output_dir(out) as tmp, one_process_model(spec, ckpt_dtype) as (ctx, chunks):
        state = sharded_state(chunks)
        _check_against_checkpoint(state["model"], dist_dir, spec)
        loaded = dist_checkpointing.load(state, str(dist_dir))
        chunks[0].load_state_dict(loaded["model"], strict=True)
        del loaded, state
        # a progress bar on the console (not convert.log) once writing takes over 2 s
        tensors = tqdm(
            iter_hf_tensors(chunks, spec, ctx), desc="writing HF tensors", unit=" tensors",
            delay=2.0, leave=False, file=console_err(),
        )  # fmt: skip
        files = write_safetensors(tensors, tmp, DTYPES[out_dtype], max_shard_bytes)
        copy_side_files(side, tmp, dtype=out_dtype)
    return {
        "out": str(out),
        "files": files,
        "dtype": out_dtype,
        "step": step if step is not None else (info.step if info else None),
    }
