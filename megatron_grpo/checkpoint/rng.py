"""Capture and restore every RNG a rank draws from, in a form ``torch.load(weights_only=True)``
accepts: tensors, ints, floats, strings, None, and dicts/lists of them — no pickled objects,
so loading a checkpoint never runs code from it.

Covered: Python's ``random``, NumPy's global ``np.random``, torch's CPU generator, the CUDA
generators (when CUDA is present), and megatron-core's model-parallel RNG tracker
(``tensor_parallel.random``: the per-TP-rank dropout streams) when it has been set up.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import numpy as np
import torch

RngState = dict[str, Any]


def _megatron_tracker() -> Any:
    """megatron's RNG tracker if this process already created one, else None.

    Reads the module flag instead of calling ``get_cuda_rng_tracker()``, which would create a
    default tracker as a side effect (and fix its class before the trainer chooses one).
    """
    tp_random = sys.modules.get("megatron.core.tensor_parallel.random")
    if tp_random is None or not getattr(tp_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False):
        return None
    tracker = tp_random.get_cuda_rng_tracker()
    return tracker if tracker.is_initialized() else None


def get_rng_state() -> RngState:
    """All RNG states of this process, weights_only-safe."""
    version, py_state, gauss = random.getstate()
    legacy = np.random.get_state(legacy=True)
    # numpy's stub types the result tuple | dict whatever ``legacy`` is; legacy=True always
    # gives the tuple (numpy/random/mtrand.pyx).
    assert isinstance(legacy, tuple), type(legacy)
    kind, keys, pos, has_gauss, cached = legacy
    state: RngState = {
        "python": {
            "version": int(version),
            "state": torch.tensor(py_state, dtype=torch.int64),
            "gauss": gauss,
        },
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    tracker = _megatron_tracker()
    if tracker is not None:
        state["megatron_tracker"] = {
            k: v.detach().cpu().clone() for k, v in tracker.get_states().items()
        }
    return state


def set_rng_state(state: RngState) -> None:
    """Restore what ``get_rng_state`` captured (in this process)."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    nps = state["numpy"]
    np.random.set_state(
        (
            nps["kind"],
            nps["keys"].numpy().astype(np.uint32),
            nps["pos"],
            nps["has_gauss"],
            nps["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "the checkpoint holds CUDA RNG states but this process has no CUDA device: "
                "resume on a GPU machine, or load with restore_rng=False."
            )
        n = torch.cuda.device_count()
        if len(state["cuda"]) != n:
            raise RuntimeError(
                f"the checkpoint holds {len(state['cuda'])} CUDA RNG states but this process "
                f"sees {n} devices: set CUDA_VISIBLE_DEVICES as when it was saved, or load with "
                "restore_rng=False."
            )
        torch.cuda.set_rng_state_all(state["cuda"])
    if "megatron_tracker" in state:
        import megatron.core.tensor_parallel.random as tp_random

        tp_random.get_cuda_rng_tracker().set_states(dict(state["megatron_tracker"]))
