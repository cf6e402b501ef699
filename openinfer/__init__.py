"""openinfer: an open LLM inference and serving engine.

Imports are lazy so that the pure-Python parts (block manager, scheduler) load without torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["LLM", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from openinfer.engine_args import EngineArgs
    from openinfer.entrypoints.llm import LLM
    from openinfer.outputs import CompletionOutput, RequestOutput
    from openinfer.sampling_params import SamplingParams


def __getattr__(name: str):
    if name == "LLM":
        from openinfer.entrypoints.llm import LLM

        return LLM
    if name == "EngineArgs":
        from openinfer.engine_args import EngineArgs

        return EngineArgs
    if name == "SamplingParams":
        from openinfer.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from openinfer import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'openinfer' has no attribute {name!r}")
