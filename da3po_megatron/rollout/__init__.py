"""Rollout: vLLM generation engines (in-process or Ray actors) and the Megatron -> vLLM weight sync.

``from da3po_megatron.rollout import EngineConfig, SamplingConfig, RolloutClient, Completion``. Importing this package
does not import vLLM or Ray; building an engine does. See docs/rollout.md.
"""

from da3po_megatron.rollout.client import RolloutClient
from da3po_megatron.rollout.types import (
    Completion,
    EngineConfig,
    EngineDeadError,
    RolloutError,
    SamplingConfig,
)

__all__ = ["Completion", "EngineConfig", "EngineDeadError", "RolloutClient", "RolloutError", "SamplingConfig"]
