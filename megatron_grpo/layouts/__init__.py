"""The one source of truth for weight layouts: HF <-> Megatron <-> vLLM names and slices.

- :mod:`.pieces`   the slice algebra (a shard = HF slices concatenated along one dim);
- :mod:`.hf`       HF tensor names and shapes;
- :mod:`.megatron` Megatron-core GPTModel names and per-(pp, vp, tp) rank shards;
- :mod:`.vllm`     vLLM names and per-TP-rank shards;
- :mod:`.io`       load HF safetensors into a sharded model, gather it back to HF.

The bridge plan, the checkpoint tools and the tests all use these; nothing else in the
project may hard-code a weight name or a slice.
"""

from megatron_grpo.layouts import hf, megatron, pieces, vllm
from megatron_grpo.layouts.megatron import MegatronLayout, UnknownParameterError
from megatron_grpo.layouts.pieces import Piece, ShardLayout, assemble, intersect, scatter

__all__ = [
    "MegatronLayout",
    "Piece",
    "ShardLayout",
    "UnknownParameterError",
    "assemble",
    "gather_hf_state_dict",
    "hf",
    "intersect",
    "iter_hf_tensors",
    "load_hf_into_megatron",
    "megatron",
    "pieces",
    "scatter",
    "vllm",
]


def __getattr__(name: str):
    # io imports torch.distributed; keep `import megatron_grpo.layouts` light for the plan CLI.
    if name in ("load_hf_into_megatron", "gather_hf_state_dict", "iter_hf_tensors"):
        from megatron_grpo.layouts import io

        return getattr(io, name)
    raise AttributeError(name)
