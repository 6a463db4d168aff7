"""Shared test set-up. Triton reads TRITON_INTERPRET once, at its first import (megatron-core imports it), so the
interpreter mode that CPU machines need is chosen here, before any test module imports anything."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
