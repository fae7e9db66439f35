"""HF safetensors directory -> megatron-core dist checkpoint (layout: checkpoint/conversion.py).

Memory: one model (TP=PP=1) plus one parameter in flight -- the HF weights are read slice
by slice from the memory-mapped safetensors files (layouts.io.load_hf_into_megatron).
"""

from __future__ import annotations

from pathlib import Path

from megatron_grpo.checkpoint.conversion import (
    HF_SUBDIR,
    CheckpointInfo,
    ConvertError,
    atomic_output_dir,
    copy_side_files,
    one_process_model,
    resolve_dtype,
    sharded_state,
    widest,
)
from megatron_grpo.layouts.io import HFCheckpointReader, load_hf_into_megatron
from megatron_grpo.models.spec import ModelSpec, load_spec


def check_hf_dir(hf_dir: Path) -> tuple[ModelSpec, HFCheckpointReader, str]:
    """Validate an HF directory before anything is written: supported architecture, every
    tensor present with the shape config.json implies, files readable. Returns the spec,
    the reader and the checkpoint's dtype."""
    if not hf_dir.is_dir():
        raise ConvertError(f"--hf {hf_dir} is not a directory")
    spec = load_spec(hf_dir)  # raises UnsupportedModelError naming the architecture
    reader = HFCheckpointReader(hf_dir)
    reader.check_shapes(spec)
    dtypes = {reader.dtype(n) for n in reader.names()}
    return spec, reader, widest(dtypes, str(hf_dir))


def hf_to_mcore(hf_dir: str | Path, out: str | Path, dtype: str | None = None) -> CheckpointInfo:
    """Convert ``hf_dir`` into a dist checkpoint at ``out`` (which must not exist)."""
    hf_dir = Path(hf_dir)
    if Path(out).exists():  # before the slow checks and imports; atomic_output_dir re-checks
        raise ConvertError(
            f"output directory {out} already exists: remove it or choose another --out"
        )
    spec, _, source_dtype = check_hf_dir(hf_dir)
    from megatron.core import dist_checkpointing

    out_dtype = resolve_dtype(source_dtype, dtype)
    info = CheckpointInfo(
        spec=spec.to_dict(),
        dtype=out_dtype,
        source=str(hf_dir.resolve()),
        parallel={"tp": 1, "pp": 1, "vpp": None},
    )
    with atomic_output_dir(out) as tmp, one_process_model(spec, out_dtype) as (ctx, chunks):
        load_hf_into_megatron(chunks, hf_dir, spec, ctx)
        dist_checkpointing.save(sharded_state(chunks), str(tmp))
        copy_side_files(hf_dir, tmp / HF_SUBDIR)
        info.write(tmp)
    return info
