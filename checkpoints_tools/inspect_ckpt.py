"""Describe a megatron dist checkpoint without building a model: its info file and every
tensor's global shape and dtype (dist_checkpointing.load_tensors_metadata)."""

from __future__ import annotations

from pathlib import Path

from megatron_grpo.checkpoint.conversion import CheckpointInfo, find_dist_checkpoint


def inspect_checkpoint(ckpt: str | Path) -> list[str]:
    """Human-readable lines describing ``ckpt``."""
    from megatron.core import dist_checkpointing

    dist_dir, step = find_dist_checkpoint(Path(ckpt))
    info = CheckpointInfo.read(dist_dir)
    lines = [f"checkpoint: {dist_dir}"]
    if info is not None:
        s = info.spec
        lines += [
            f"model: {s['architecture']} ({s['family']}), {s['num_layers']} layers, hidden "
            f"{s['hidden_size']}, heads {s['num_heads']}/{s['num_kv_heads']} kv, vocab "
            f"{s['vocab_size']}, tied={s['tie_word_embeddings']}",
            f"dtype: {info.dtype}; written at {info.parallel}; source: {info.source}",
        ]
    if step is None and info is not None:
        step = info.step
    if step is not None:
        lines.append(f"step: {step}")
    meta = dist_checkpointing.load_tensors_metadata(str(dist_dir))
    total = 0
    for key in sorted(meta):
        sh = meta[key]
        shape = tuple(getattr(sh, "global_shape", ()))
        n = 1
        for d in shape:
            n *= d
        total += n
        lines.append(f"  {key}  {shape}  {str(getattr(sh, 'dtype', '?')).replace('torch.', '')}")
    lines.append(f"{len(meta)} tensors, {total:,} elements")
    return lines
