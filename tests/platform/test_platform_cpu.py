"""The CPU platform layer: each patch does what PATCHES says, applying twice is harmless,
and no other module of the project touches CUDA to make CPU runs work."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only layer")


@pytest.fixture(scope="module")
def platform():
    from megatron_grpo.platform import cpu

    assert cpu.apply_cpu_platform() is True
    return cpu


def test_apply_is_idempotent(platform):
    patched = torch.cuda.current_device
    mode = platform._state["mode"]
    assert platform.apply_cpu_platform() is True
    assert torch.cuda.current_device is patched
    assert platform._state["mode"] is mode
    assert platform.is_applied()
    # the mode is on the stack once, not twice
    from torch.overrides import _get_current_function_mode_stack

    stack = _get_current_function_mode_stack()
    assert sum(isinstance(m, platform.CudaToCpuDeviceMode) for m in stack) == 1


def test_current_device_and_synchronize(platform):
    assert torch.cuda.current_device() == torch.device("cpu")
    torch.cuda.synchronize()  # no-op instead of "Torch not compiled with CUDA enabled"
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"


def test_current_stream_is_patched_only_where_megatron_calls_it(platform):
    """megatron-core >= 0.19 waits on the current stream before each grad sync; older
    releases never ask for it, so the layer leaves torch.cuda.current_stream alone there."""
    from packaging.version import Version

    from megatron_grpo.platform.versions import installed_version

    installed = Version(installed_version("megatron-core").split("+")[0])
    patched = torch.cuda.current_stream is platform._cpu_current_stream
    assert patched == (installed >= Version(platform.CURRENT_STREAM_SINCE))
    if patched:
        stream = torch.cuda.current_stream()
        stream.wait_event(None)
        stream.wait_stream(stream)


@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda"), 0])
def test_factory_device_is_rewritten(platform, device):
    for make in (torch.empty, torch.zeros, torch.ones):
        assert make(3, device=device).device.type == "cpu"
    assert torch.tensor([1.0], device=device).device.type == "cpu"
    assert torch.arange(3, device=device).device.type == "cpu"


def test_tensor_and_module_cuda(platform):
    t = torch.ones(2)
    assert t.cuda() is t
    assert t.to("cuda").device.type == "cpu"
    assert t.to(0).device.type == "cpu"
    assert t.to("cuda", torch.float64).dtype == torch.float64
    m = torch.nn.Linear(2, 2)
    assert m.cuda() is m
    # non-device arguments are untouched
    assert t.to(torch.float16).dtype == torch.float16


def test_rng_is_the_cpu_generator(platform):
    torch.cuda.manual_seed(7)
    a = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(a, torch.rand(3))
    state = torch.cuda.get_rng_state()
    x = torch.rand(2)
    torch.cuda.set_rng_state(state)
    assert torch.equal(x, torch.rand(2))


def test_megatron_rng_tracker_forks_cpu_state(platform):
    from megatron.core.tensor_parallel import random as tp_random

    state = tp_random._get_cuda_rng_state(clone=True)
    x = torch.rand(2)
    tp_random._set_cuda_rng_state(state)
    assert torch.equal(x, torch.rand(2))
    tracker = tp_random.CudaRNGStatesTracker()
    tracker.add("stream", 123)
    before = torch.get_rng_state()
    with tracker.fork("stream"):
        inside = torch.rand(2)
    assert torch.equal(torch.get_rng_state(), before)  # fork restores the default stream
    torch.manual_seed(123)
    assert torch.equal(inside, torch.rand(2))


def test_megatrons_clip_grad_by_total_norm_fp32_runs_unpatched(platform):
    """megatron's own clip_grad_by_total_norm_fp32 asserts
    ``param.grad.type() == 'torch.cuda.FloatTensor'``: the layer's Tensor.type() answer lets
    it scale fp32 grads on CPU (no replacement of the function), and a non-fp32 grad is
    still refused."""
    from megatron.core.optimizer import clip_grads

    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 2.0)  # norm 4
    clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
    assert torch.allclose(p.grad, torch.full((4,), 0.5), atol=1e-6)
    p.grad = torch.full((4,), 0.1)
    clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=0.2)
    assert torch.allclose(p.grad, torch.full((4,), 0.1))  # below max: untouched
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    p.grad = torch.ones(4, dtype=torch.float64)
    with pytest.raises(AssertionError):
        clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)


def test_every_replaced_call_is_listed_in_patches_with_the_file_it_answers(platform):
    """Each attribute ``apply_cpu_platform`` assigns is named by a ``PATCHES`` target, and each
    entry names the megatron-core file (a .py) whose behaviour it answers."""
    body = ast.parse(textwrap.dedent(inspect.getsource(platform.apply_cpu_platform)))
    replaced = {
        t.attr
        for node in ast.walk(body)
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Attribute)
    }
    assert "current_device" in replaced and "_set_cuda_rng_state" in replaced
    listed = set(re.findall(r"\w+", " ".join(p.target for p in platform.PATCHES)))
    assert replaced - listed == set(), "patched but not listed in PATCHES"
    for patch in platform.PATCHES:
        assert patch.target and ".py" in patch.answers, patch


# A TorchFunctionMode that only counts calls and passes each one through unchanged
# (``bench ops``' host-sync counter) redirects nothing.
COUNTING_MODES = {"bench/ops/count.py"}


def test_no_cuda_hacks_elsewhere():
    """Only platform/cpu.py may redirect CUDA calls (docs/cpu-platform.md)."""
    root = Path(__file__).resolve().parents[2] / "megatron_grpo"
    hack = re.compile(
        r"torch\.cuda\.\w+\s*=[^=]|torch\.Tensor\.cuda\s*=[^=]|TorchFunctionMode|"
        r"_set_cuda_rng_state\s*=[^=]|_get_cuda_rng_state\s*=[^=]"
    )
    counting = re.compile(
        r"torch\.cuda\.\w+\s*=[^=]|torch\.Tensor\.cuda\s*=[^=]|_cuda_rng_state\s*=[^=]"
    )
    offenders = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if p.name != "cpu.py"
        and (counting if str(p.relative_to(root)) in COUNTING_MODES else hack).search(p.read_text())
    ]
    assert offenders == []


def test_tensor_type_names_the_cuda_type_for_megatrons_optimizers(platform):
    """megatron's optimizers file parameters by ``param.type()`` against torch.cuda.* names
    (optimizer/optimizer.py, distrib_optimizer.py); the layer answers with the CUDA name of
    the dtype, and ``type(dtype)`` (a conversion) is untouched."""
    assert torch.zeros(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(2).type() == "torch.cuda.FloatTensor"
    assert torch.nn.Parameter(torch.zeros(2, dtype=torch.float16)).type() == "torch.cuda.HalfTensor"
    converted = torch.zeros(2).type(torch.float64)
    assert converted.dtype == torch.float64 and converted.device.type == "cpu"


def test_moe_dispatcher_streams_and_split_sizes(platform):
    """The alltoall MoE dispatcher's side stream, stream context and event are CPU no-ops,
    and its split sizes come out as numpy arrays, as the GPU path's device-to-host copy
    gives them (transformer/moe/token_dispatcher.py)."""
    import numpy as np
    from megatron.core.transformer.moe import token_dispatcher

    stream = torch.cuda.Stream()
    stream.wait_stream(stream)  # (current_stream is patched from megatron-core 0.19 only)
    with torch.cuda.stream(stream):  # unpatched: a no-op without a CUDA device index
        event = stream.record_event()
    event.synchronize()
    splits = torch.tensor([3, 5])
    moved = token_dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True, record_stream=True)
    assert isinstance(moved, np.ndarray) and moved.tolist() == [3, 5]
    splits[0] = 7  # a copy, as the device-to-host copy is
    assert moved.tolist() == [3, 5]
    assert token_dispatcher.maybe_move_tensor_to_cpu(splits) is splits
