"""The CPU backend vLLM loads: vLLM's CPU_MLA (its prefill, its head size: 576 only) with quantmla's cache
and decode (`backend.QuantMLAImplMixin`), and a guard in the CPU_ATTN slot (non-MLA models); the AMX_MLA
slot's guard is `guards.AMX_MLA`."""

from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

from quantmla.integrations.vllm import settings
from quantmla.integrations.vllm.backend import QuantMLABackendMixin, QuantMLAImplMixin
from quantmla.integrations.vllm.guards import refuse_if_asked


class QuantMLACPUImpl(QuantMLAImplMixin, CPUMLAImpl):
    def __init__(self, num_heads, head_size, *args, **kwargs):
        # vLLM's CPU MLA (whose prefill this reuses) is built for one head size; say so before it fails later.
        served = CPUMLABackend.get_supported_head_sizes()
        if head_size not in served:
            raise ValueError(f"quantmla's vLLM CPU backend serves MLA head size {served} (kv_lora_rank 512 + rope "
                             f"64), the only one vLLM's CPU MLA supports; this model has MLA head size {head_size} "
                             f"(kv_lora_rank {kwargs.get('kv_lora_rank')} + rope {kwargs.get('qk_rope_head_dim')})")
        super().__init__(num_heads, head_size, *args, **kwargs)
        self._quantmla_setup()


class QuantMLACPUBackend(QuantMLABackendMixin, CPUMLABackend):
    """vLLM's CPU MLA backend (its prefill, its head sizes: 576 only) with quantmla's cache and decode.
    Keeps the CPU_MLA name: it takes that slot of vLLM's backend registry."""

    @staticmethod
    def get_impl_cls():
        return QuantMLACPUImpl


class _NonMLAGuardImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs):
        refuse_if_asked("vLLM runs {model} with ordinary attention: it does not use MLA (multi-head latent "
                        "attention): quantmla only quantizes MLA caches. (vLLM's MiniCPM3 is such a model: it "
                        "expands the latent into per-head keys and values.) Serve it with `quantmla serve`, or set "
                        f"{settings.ENV}=bf16 to run it unquantized.")
        super().__init__(*args, **kwargs)


class NonMLAGuardBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend, unchanged, except that it refuses to start when quantmla was asked for
    (QUANTMLA_VLLM_CACHE set) on a model without MLA, instead of silently serving an unquantized cache."""

    @staticmethod
    def get_impl_cls():
        return _NonMLAGuardImpl
