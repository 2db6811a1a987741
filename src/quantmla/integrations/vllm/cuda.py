"""The CUDA variant of the backend: vLLM's TRITON_MLA (its prefill, its absorption) with quantmla's cache
and the Triton decode kernel `mla_decode`. Written against vLLM 0.32's TritonMLA classes but NOT run:
vLLM's CUDA build cannot be installed on the GPU machine available to this project (see the README)."""

from __future__ import annotations

from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend, TritonMLAImpl

from quantmla.integrations.vllm.backend import QuantMLAImplMixin, QuantMLAMetadataBuilder, quantmla_spec


class QuantMLATritonImpl(QuantMLAImplMixin, TritonMLAImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._quantmla_setup()


class QuantMLATritonBackend(TritonMLABackend):
    @classmethod
    def customize_spec(cls, spec):
        return quantmla_spec(super().customize_spec(spec))

    @staticmethod
    def get_impl_cls():
        return QuantMLATritonImpl

    @staticmethod
    def get_builder_cls():
        return QuantMLAMetadataBuilder
