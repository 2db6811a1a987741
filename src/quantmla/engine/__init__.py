"""quantmla's serving engine (nano-vllm's shape): `LLM` + `SamplingParams`, the vLLM offline API over the paged
quantized MLA cache. `quantmla.engine.server` puts an OpenAI-compatible HTTP server in front of it."""

from quantmla.engine.llm import LLM, RequestOutput, StepOutput
from quantmla.engine.sampler import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StepOutput"]
