"""Triton kernels, each a @triton.jit + a thin launcher with its plain-torch reference beside it.

`mla_decode` (alias `decode`): absorbed-MLA decode over a `quantmla.cache.paged.PagedMLACache`; a whole
layer's decode step around it (projections, cache write, o_proj) is `quantmla.decode_step.decode_step`.
`append_decode_fused`: the decode step's cache write in one launch; its reference is
`PagedMLACache.append_decode`.
`mla_decode_cuda` (module): a CUDA kernel for the same decode over int4/int2 and fp8 caches with few heads (nvcc +
ctypes; `mla_decode` picks it where it measured faster: <= 32 heads, or few sequences of more);
`mla_decode_many_heads` (module): a Hopper (wgmma) Gluon kernel for 64 heads per CTA over int4/int2/fp8 caches
(`mla_decode`'s pick above 32 heads on Hopper); `mla_decode_gluon` (module): a Hopper Gluon kernel for INT4/INT4
caches with few heads (opt-in through $QUANTMLA_DECODE_KERNEL=gluon);
`decode_kernel_name` says which kernel runs.
"""

from quantmla.kernels.cache_write import append_decode_fused
from quantmla.kernels.mla_decode import KernelConfig, decode, default_config, mla_decode, mla_decode_reference

__all__ = ["KernelConfig", "append_decode_fused", "decode", "default_config", "mla_decode", "mla_decode_reference"]
