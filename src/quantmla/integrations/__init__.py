"""Bridges from quantmla's cache into other serving engines (vLLM: `quantmla.integrations.vllm`)."""
