"""openinfer: an open LLM inference and serving engine."""
from openinfer.entrypoints.llm import LLM
from openinfer.outputs import CompletionOutput, RequestOutput
from openinfer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
