"""The CUDA variant of the backend: vLLM's TRITON_MLA (its prefill, its absorption) with quantmla's cache
and the Triton decode kernel `mla_decode`. Written against vLLM 0.32's TritonMLA classes but NOT run:
vLLM's CUDA build cannot be installed on the GPU machine available to this project (see the README)."""

from __future__ import annotations

from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend, TritonMLAImpl

from quantmla.integrations.vllm.backend import QuantMLABackendMixin, QuantMLAImplMixin


class QuantMLATritonImpl(QuantMLAImplMixin, TritonMLAImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._quantmla_setup()


class QuantMLATritonBackend(QuantMLABackendMixin, TritonMLABackend):
    @staticmethod
    def get_impl_cls():
        return QuantMLATritonImpl
